"""Read-ahead into the CPU caches: while the caller runs the Python between two kernel calls, the kernels'
idle helper thread reads the next layer's weights (dense, then the guessed experts held in memory), so the
kernels find them in L3. One core streams DRAM at half the L3 speed or less (docs/kernels.md, "Read-ahead
into the caches"). No value changes. Needs 2+ kernel threads (an idle core) and CPU tensors.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from engine.kernels.native import _kernels
from engine.kernels.rows import kernel_threads

MIN_BYTES = 16 * 1024  # smaller arrays (norm weights, biases) are not worth a range

_lock = threading.Lock()
_held: list[object] = []  # what the helper may be reading: kept alive until the next request replaces it


def read_ahead_available() -> bool:
    return _kernels is not None and kernel_threads() >= 2


class ReadsOtherFormInDecode:
    """A module whose decode reads some weights in another form (MLA's int8 wkv_b): ``decode_unread`` names them."""

    def decode_unread(self) -> list[torch.Tensor]:
        return []


def module_arrays(module: nn.Module) -> list[torch.Tensor]:
    """A module's CPU parameters and buffers of MIN_BYTES or more in registration order (a forward's read
    order), less those its decode does not read."""
    unread = {id(t) for sub in module.modules() if isinstance(sub, ReadsOtherFormInDecode) for t in sub.decode_unread()}
    arrays = []
    for sub in module.modules():
        for tensor in (*sub.parameters(recurse=False), *sub.buffers(recurse=False)):
            if id(tensor) in unread:
                continue
            if tensor.device.type == "cpu" and tensor.numel() * tensor.element_size() >= MIN_BYTES:
                arrays.append(tensor)
    return arrays


def _address_and_bytes(array: torch.Tensor | np.ndarray) -> tuple[int, int]:
    if isinstance(array, np.ndarray):
        return array.ctypes.data, array.nbytes
    return array.data_ptr(), array.numel() * array.element_size()


def request_read_ahead(arrays: Sequence[torch.Tensor | np.ndarray]) -> None:
    """Replace the helper's request with these contiguous arrays (others skipped); returns at once."""
    if not read_ahead_available():
        return
    arrays = [a for a in arrays if _contiguous(a)]
    with _lock:
        _kernels.read_ahead([_address_and_bytes(a) for a in arrays], kernel_threads())
        _held[:] = arrays  # the C side no longer touches the previous arrays: they may go


def stop_read_ahead() -> None:
    """Drop the pending request and its arrays, so a closed model's weights (or a store's RAM) can be freed."""
    if _kernels is not None:
        with _lock:
            _kernels.read_ahead([], 2)
            _held.clear()


def _contiguous(array: torch.Tensor | np.ndarray) -> bool:
    if isinstance(array, np.ndarray):
        return array.flags.c_contiguous
    return array.is_contiguous()
