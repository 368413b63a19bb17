"""Helpers the kernel tests share."""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Callable

import pytest
import torch


def _guarded(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """A uint8 tensor of nbytes ending exactly where an unreadable page starts."""
    page = mmap.PAGESIZE
    pages = -(-nbytes // page) + 1
    area = mmap.mmap(-1, pages * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(area))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    assert libc.mprotect(base + (pages - 1) * page, page, 0) == 0  # PROT_NONE
    start = (pages - 1) * page - nbytes
    return area, torch.frombuffer(area, dtype=torch.uint8, count=nbytes, offset=start)


@pytest.fixture
def guarded() -> Callable[[int], tuple[mmap.mmap, torch.Tensor]]:
    """nbytes -> (the mapping, a uint8 tensor of nbytes ending where an unreadable page starts): a kernel that reads
    past it dies (run it in a forked child)."""
    return _guarded
