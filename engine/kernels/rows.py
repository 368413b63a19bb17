"""Batch invariance: rows of independent requests, computed together, each exactly as if alone.

A matmul over B rows need not give a row the bits it gets over 1 row (BLAS picks kernels and summation
orders by shape). Inside ``rows_alone()`` every matmul keeps each row's arithmetic that of a one-row call,
so greedy text is the same whether a request is decoded alone or beside others.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar, overload

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.native import BUILT, _kernels

T = TypeVar("T")

_alone: ContextVar[bool] = ContextVar("rows_alone", default=False)
_segments: ContextVar[tuple[int, ...] | None] = ContextVar("rows_in_segments", default=None)
_kernel_threads: ContextVar[int | None] = ContextVar("kernel_threads", default=None)


@contextmanager
def _holding(var: ContextVar[T], value: T) -> Iterator[None]:
    """``var`` set to ``value`` inside, back to what it was after."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def rows_alone() -> AbstractContextManager[None]:
    """Compute every row of the matmuls inside as a one-row call would."""
    return _holding(_alone, True)


def computing_alone() -> bool:
    return _alone.get()


def rows_in_segments(sizes: Sequence[int]) -> AbstractContextManager[None]:
    """Compute the rows of every op inside ([rows, last dim]) as runs of these lengths, each with the bits
    of its own call (several requests' prompt chunks in one forward)."""
    return _holding(_segments, tuple(sizes))


def one_segment() -> AbstractContextManager[None]:
    """Inside rows_in_segments(), ops over one segment's rows only."""
    return _holding(_segments, None)


def row_segments(rows: int) -> tuple[int, ...] | None:
    """The segments an op over ``rows`` rows splits into; None outside rows_in_segments() or with one."""
    sizes = _segments.get()
    if sizes is None or len(sizes) == 1 or computing_alone():
        return None
    if sum(sizes) != rows:
        raise ValueError(f"an op over {rows} rows inside rows_in_segments{sizes} (they add up to {sum(sizes)})")
    return sizes


def by_segment(fn: Callable[..., torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
    """fn(*xs) for a row-wise fn of tensors [..., k_i] -> [..., k]; per segment inside rows_in_segments()."""
    sizes = row_segments(xs[0].numel() // max(xs[0].shape[-1], 1)) if xs[0].numel() else None
    if sizes is None:
        return fn(*xs)
    with one_segment():
        parts = zip(*(x.reshape(-1, x.shape[-1]).split(sizes) for x in xs), strict=True)
        out = torch.cat([fn(*part) for part in parts])
    return out.view(*xs[0].shape[:-1], out.shape[-1])


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight^T; row by row inside rows_alone(), per segment inside rows_in_segments()."""
    if row_segments(x.numel() // x.shape[-1]) is not None:
        return by_segment(partial(F.linear, weight=weight), x)
    if not computing_alone() or x.numel() <= x.shape[-1]:
        return F.linear(x, weight)
    flat = x.reshape(-1, x.shape[-1])
    out = torch.cat([F.linear(flat[r : r + 1], weight) for r in range(flat.shape[0])])
    return out.view(*x.shape[:-1], weight.shape[0])


@overload
def per_row(fn: Callable[..., torch.Tensor], *xs: torch.Tensor) -> torch.Tensor: ...
@overload
def per_row(fn: Callable[..., tuple[torch.Tensor, ...]], *xs: torch.Tensor) -> tuple[torch.Tensor, ...]: ...
def per_row(fn: Callable[..., Any], *xs: torch.Tensor) -> Any:
    """fn(*xs) for a row-wise fn over tensors of N rows -> a tensor or tuple; row by row inside rows_alone():
    vectorised transcendentals give an [N, k] block other bits than a [1, k] row on some CPUs
    (docs/kernels.md, "Figures behind engine comments")."""
    if not computing_alone():
        return by_segment(fn, *xs)
    if xs[0].shape[0] == 1:
        return fn(*xs)
    results = [fn(*rows) for rows in zip(*(x.split(1) for x in xs), strict=True)]
    if isinstance(results[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*results, strict=True))
    return torch.cat(results)


def in_row_chunks(x: torch.Tensor, size: int, matmul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """matmul over x [N, in] at most ``size`` rows per call, concatenated."""
    if x.shape[0] <= size:
        return matmul(x)
    return torch.cat([matmul(rows) for rows in x.split(size)])


class Linear(nn.Linear):
    """nn.Linear (same parameters, same checkpoint names) that honours rows_alone()."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            return super().forward(x)
        return linear(x, self.weight)

    if TYPE_CHECKING:  # torch types every Module call as Any: this one's is forward's
        __call__ = forward


# Below this many multiply-adds a thread's wake-up outweighs the split (docs/kernels.md, "Threads").
PARALLEL_PRODUCT_MACS = 1 << 23
# How old the helper thread's core-sharing verdict may be: it measures only between kernel calls, and a
# long-cache attention layer runs seconds of torch without one (docs/kernels.md, "Figures behind engine comments").
SHARE_VERDICT_NS = 60_000_000_000


def products_on_threads(macs: int) -> AbstractContextManager[None]:
    """torch_on_kernel_threads() around a large product, unless the core is shared (a torch product waits
    for its slowest thread). Products only: a transcendental's bits would follow the split."""
    if macs < PARALLEL_PRODUCT_MACS or kernel_threads() < 2 or cores_shared():
        return nullcontext()
    return torch_on_kernel_threads()


# torch's elementwise loops (ATen's vectorized loop) take two vectors a step, at most 2 x 16 float32, and
# at::parallel_for gives each of n tasks ceil(numel / n) elements, tasks of at least TORCH_GRAIN elements.
ELEMENTWISE_ALIGN = 64
TORCH_GRAIN = 32768


def elementwise_on_threads(x: torch.Tensor) -> AbstractContextManager[None]:
    """torch_on_kernel_threads() around an elementwise op on contiguous ``x`` (exp: a transcendental) where
    torch's split of x falls on ELEMENTWISE_ALIGN boundaries: every element then takes the vector path it
    takes on one thread, so the bits do not follow the split. Else (or the core shared) one thread."""
    threads, numel = kernel_threads(), x.numel()
    tasks = min(threads, -(-numel // TORCH_GRAIN))
    if tasks < 2 or not x.is_contiguous() or -(-numel // tasks) % ELEMENTWISE_ALIGN or cores_shared():
        return nullcontext()
    return torch_on_kernel_threads()


def cores_shared() -> bool:
    """The helper thread's recent verdict (engine/csrc/split.c watch_share); False without one."""
    return BUILT and bool(_kernels.cores_shared(SHARE_VERDICT_NS))


@contextmanager
def torch_on_kernel_threads() -> Iterator[None]:
    """Inside torch_on_one_thread(), torch's ops on the kernel threads again. A product keeps its bits:
    torch splits it by output, not by sum."""
    threads, held = kernel_threads(), torch.get_num_threads()
    if threads != held:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if threads != held:
            torch.set_num_threads(held)


def kernel_threads() -> int:
    """Threads the C kernels split their output rows over (torch's count before torch_on_one_thread())."""
    threads = _kernel_threads.get()
    return torch.get_num_threads() if threads is None else threads


@contextmanager
def torch_on_one_thread() -> Iterator[None]:
    """A forward pass: torch's own ops run on one thread, the C kernels on all of torch's threads.

    A decode step is hundreds of tiny torch ops whose wake-ups cost more than they save, and on a busy
    machine every parallel op waits for a descheduled thread (docs/kernels.md, "Threads"). The kernels'
    split does not wait for a thread that is not running."""
    threads = torch.get_num_threads()
    token = _kernel_threads.set(threads)
    if threads > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if threads > 1:
            torch.set_num_threads(threads)
        _kernel_threads.reset(token)
