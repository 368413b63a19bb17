"""The int8-activation mode and the prompt-rows mode (engine/kernels/q8.py): ContextVars, scoped to a block of
code, in their own module so decode_ops asks them without importing the q8 matmuls."""

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


_prompt: ContextVar[bool] = ContextVar("prompt_rows", default=False)


@contextmanager
def prompt_rows(enabled: bool = True) -> Iterator[None]:
    """The int8 kernel matmuls inside compute a prompt's rows (Model.forward_prompt, forward_prompts) as tile
    GEMMs (engine/csrc/q8_tiles.h): the same int8 values, another order of the float sum than decoded rows."""
    token = _prompt.set(enabled)
    try:
        yield
    finally:
        _prompt.reset(token)


def rows_are_prompt() -> bool:
    return _prompt.get()
