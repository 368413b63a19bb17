"""The resident dense part in one arena of transparent huge pages.

A decode step reads every dense weight once: hundreds of MB spread over a thousand tensors, each allocated
on its own and so on 4 KiB pages where the kernel grants huge pages only to regions advised so (the
routed experts' RAM slots, one large aligned block, already get them). On 4 KiB pages the hardware
prefetchers stop at every page boundary and every page needs its own TLB entry; the same reads from 2 MiB
pages are faster, and so is decode with the dense part moved (docs/benchmarks-log.md, "The dense part on huge
pages").
"""

from __future__ import annotations

import mmap
import sys

import torch
from torch import nn

ALIGNMENT = 64  # each tensor starts on a cache line
HUGE_PAGE = 2 << 20


def _key(t: torch.Tensor) -> tuple[int, torch.dtype, tuple[int, ...]]:
    return t.data_ptr(), t.dtype, tuple(t.shape)


def _movable(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.is_contiguous() and t.numel() > 0


def _arena(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] in a private anonymous mapping advised MADV_HUGEPAGE (pages faulted as it is written)."""
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel built without transparent huge pages refuses the advice: 4 KiB pages then
        pass
    return torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive while any view of it lives


def hold_in_huge_pages(model: nn.Module) -> int:
    """Copy every contiguous CPU parameter and buffer of ``model`` into one huge-page arena, through
    ``Module._apply`` so the modules drop what they described of the old tensors (the C steps' plans, the
    coded matrices' addresses). Tensors that are one (tied weights) stay one. Returns the bytes moved; 0
    off Linux (no MADV_HUGEPAGE) or without such tensors."""
    if sys.platform != "linux":
        return 0
    offsets: dict[tuple[int, torch.dtype, tuple[int, ...]], int] = {}
    end = 0
    for t in [*model.parameters(), *model.buffers()]:
        if _movable(t) and (key := _key(t)) not in offsets:
            offsets[key] = end
            end += -(-t.numel() * t.element_size() // ALIGNMENT) * ALIGNMENT
    if end == 0:
        return 0
    arena = _arena(-(-end // HUGE_PAGE) * HUGE_PAGE)
    moved: dict[tuple[int, torch.dtype, tuple[int, ...]], torch.Tensor] = {}

    def into_arena(t: torch.Tensor) -> torch.Tensor:
        key = _key(t)
        if key not in offsets:
            return t
        if key not in moved:
            start = offsets[key]
            copy = arena[start : start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            moved[key] = copy.copy_(t)
        return moved[key]

    with torch.no_grad():
        model._apply(into_arena)
    return end
