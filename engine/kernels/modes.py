"""The int8-activation mode: inside ``int8_activations()`` the kernel matmuls quantise x to int8 per block
of 32 columns (engine/kernels/q8.py says how). A ContextVar, so it holds for a block of code and the
threads it runs, never a global set by import; its own module, so the small C ops (decode_ops.py) ask it
without importing the q8 matmuls."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_enabled: ContextVar[bool] = ContextVar("int8_activations", default=False)


@contextmanager
def int8_activations(enabled: bool = True) -> Iterator[None]:
    """Quantise the activations of the kernel matmuls inside to int8 (see the module docstring)."""
    token = _enabled.set(enabled)
    try:
        yield
    finally:
        _enabled.reset(token)


def activations_are_int8() -> bool:
    return _enabled.get()
