"""Read-ahead into the CPU caches: the next layer's weights, read by the kernels' idle helper thread.

A decode step alternates weight-bound kernel calls with Python that touches almost no memory (norms,
rope, routing, small torch ops). One core streams a matrix from DRAM at half the speed or less that the
same kernel reads weights already in L3 (docs/kernels.md, "Read-ahead into the caches"). So where L3
holds a request several times over (colibri_stream/planning/read_ahead.py decides per machine), while the
caller runs the Python between two kernel calls, the helper thread (engine/csrc/split.c, read_ahead.c),
otherwise idle, reads the weights the next layer will use: its dense part, then the routed experts the
prefetch guess names and the expert source already holds in memory. The kernels then find them in the
caches. The same bytes come from DRAM, off the critical path; no value changes.

Only with 2+ kernel threads (with one there is no idle core) and only for CPU tensors.
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
    # reflection: a build of the C extension older than read_ahead.c lacks it
    return _kernels is not None and kernel_threads() >= 2


class ReadsOtherFormInDecode:
    """A module whose decode step reads some of its weights in another form (e.g. MLA's wkv_b as int8
    records): ``decode_unread`` names those the read-ahead leaves out."""

    def decode_unread(self) -> list[torch.Tensor]:
        return []


def module_arrays(module: nn.Module) -> list[torch.Tensor]:
    """A module's CPU parameters and buffers of MIN_BYTES or more, in registration order (for a Block:
    attention, then the FFN: the order a forward reads them), less those a submodule's decode step does
    not read (``ReadsOtherFormInDecode``)."""
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
    """Have the helper thread read these contiguous arrays, in order, into the caches, instead of
    whatever it was asked before. Returns at once. Non-contiguous arrays are skipped."""
    if not read_ahead_available():
        return
    arrays = [a for a in arrays if _contiguous(a)]
    with _lock:
        _kernels.read_ahead([_address_and_bytes(a) for a in arrays], kernel_threads())
        _held[:] = arrays  # the C side no longer touches the previous arrays: they may go


def stop_read_ahead() -> None:
    """Drop the pending request and the arrays held for it: a closed model's weights (or a store's RAM
    block, through its slots) can then be freed."""
    if _kernels is not None:
        with _lock:
            _kernels.read_ahead([], 2)
            _held.clear()


def _contiguous(array: torch.Tensor | np.ndarray) -> bool:
    if isinstance(array, np.ndarray):
        return array.flags.c_contiguous
    return array.is_contiguous()
