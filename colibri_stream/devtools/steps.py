"""One sequence's forward steps by hand, for tests that compare paths the runtime never takes apart
(chunked prefill against one forward, a batched decode against solo ones). The runtime itself runs
every request as a ContinuousBatch (colibri_stream/runtime/batching.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from colibri_stream.planning.activations import PREFILL_CHUNK_TOKENS
from engine.core.interfaces import Cache, Model
from engine.core.sources import Experts


def prefill(
    model: Model[Any], ids: Sequence[int], cache: Cache, experts: Experts, chunk: int = PREFILL_CHUNK_TOKENS
) -> torch.Tensor:
    """Run the prompt from the cache's end, ``chunk`` positions per forward; the last position's logits
    [vocab]. A chunk attends to the cache the earlier ones filled: the same logits as one forward."""
    assert ids, "an empty prompt"
    ids = list(ids)
    for start in range(0, len(ids), chunk):
        tokens = torch.tensor([ids[start : start + chunk]], dtype=torch.long, device=model.device)
        logits = model(tokens, cache.length, cache, experts, last_only=True)
    return logits[0, -1]


def decode_one_token(model: Model[Any], token: int, cache: Cache, experts: Experts) -> torch.Tensor:
    """One decode step: logits [vocab] of ``token`` appended at the cache's end."""
    tokens = torch.tensor([[token]], dtype=torch.long, device=model.device)
    return model(tokens, cache.length, cache, experts)[0, -1]
