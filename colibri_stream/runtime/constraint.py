"""What a generation may write next: a per-sequence ``TokenConstraint`` (a grammar matcher, text/grammar.py)
masks the logits before sampling, and learns each token taken.

The batch asks ``allowed`` before every token of a constrained sequence, samples from the masked logits
(greedy or not: a masked id gets -inf, so probability 0), then calls ``advance`` with the token. Once the
grammar is complete the constraint allows only its stop ids, so the sequence ends the way any answer
does, on a stop id. A sequence without a constraint never reaches this module: its tokens are those it
had before constrained decoding existed.
"""

from __future__ import annotations

from typing import Protocol

import torch


class TokenConstraint(Protocol):
    """One sequence's constraint, stateful: it follows the tokens the sequence takes."""

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """bool [vocab_size]: the ids that may come next (never all False: a dead end allows the stop ids)."""
        ...

    def advance(self, token: int) -> None:
        """The sequence took ``token`` (one ``allowed`` said it may)."""
        ...

    @property
    def finished(self) -> bool:
        """The grammar is complete: only a stop id may follow."""
        ...


def masked(logits: torch.Tensor, constraint: TokenConstraint) -> torch.Tensor:
    """logits [vocab] with every id the constraint does not allow at -inf (a copy: the caller's logits,
    from which logprobs are reported, stay the model's)."""
    allowed = constraint.allowed(logits.shape[-1]).to(logits.device)
    return logits.masked_fill(~allowed, float("-inf"))
