"""Anthropic's extended thinking on a local model: the request's ``thinking`` / ``output_config`` and the
``thinking`` blocks clients send back.

``thinking: {"type": "enabled", "budget_tokens": N}`` or ``{"type": "adaptive"}`` turns the model's own
thinking mode on (serve/thinking.py; ``budget_tokens`` and ``output_config.effort`` are accepted and do
not bound the reasoning: ``max_tokens`` bounds the whole answer); ``{"type": "disabled"}`` or no
``thinking`` turns it off where the template has a switch. The answer's reasoning is returned as a
``thinking`` block whose ``signature`` is the server's HMAC of its text (serve/signing.py), only when
thinking was asked for.

A thinking block sent back in an assistant message must carry the signature this server gave it (else
400: a client cannot put words in the model's reasoning); its text is then the assistant's
``reasoning_content``, which the chat template renders where it does (most drop earlier turns'
reasoning). ``redacted_thinking`` blocks (Anthropic's encrypted reasoning, never made here) are accepted
and dropped.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from colibri_stream.serve.schemas import STRICT, ApiError
from colibri_stream.serve.signing import Signer

PURPOSE = "anthropic-thinking"  # what the signatures of these blocks are for (Signer's purpose)


class ThinkingConfig(BaseModel):
    model_config = STRICT
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(None, ge=1)


class OutputConfig(BaseModel):
    model_config = STRICT
    effort: Literal["low", "medium", "high", "max"] | None = None


class ThinkingBlock(BaseModel):
    """An earlier answer's reasoning, sent back with the signature it was given."""

    model_config = STRICT
    type: Literal["thinking"]
    thinking: str
    signature: str = Field(max_length=1024)


class RedactedThinkingBlock(BaseModel):
    model_config = STRICT
    type: Literal["redacted_thinking"]
    data: str = ""


def wants_thinking(config: ThinkingConfig | None) -> bool:
    return config is not None and config.type != "disabled"


def thinking_block(signer: Signer, text: str) -> dict[str, str]:
    return {"type": "thinking", "thinking": text, "signature": signer.sign(PURPOSE, text)}


def verified_reasoning(signer: Signer, block: ThinkingBlock, where: str) -> str:
    """The block's text when its signature is this server's; 400 naming the block otherwise."""
    if not signer.verify(PURPOSE, block.thinking, block.signature):
        raise ApiError(
            400,
            f"{where}.signature: this thinking block's signature is not one this server gave "
            "(a thinking block must come back unchanged)",
            "invalid_signature",
            f"{where}.signature",
        )
    return block.thinking
