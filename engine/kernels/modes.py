"""The int8-activation mode (engine/kernels/q8.py): a ContextVar, scoped to a block of code, in its own
module so decode_ops asks it without importing the q8 matmuls."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_enabled: ContextVar[bool] = ContextVar("int8_activations", default=False)


@contextmanager
def int8_activations(enabled: bool = True) -> Iterator[None]:
    """Quantise the activations of the kernel matmuls inside to int8."""
    token = _enabled.set(enabled)
    try:
        yield
    finally:
        _enabled.reset(token)


def activations_are_int8() -> bool:
    return _enabled.get()
