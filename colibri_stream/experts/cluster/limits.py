"""What a worker accepts from its coordinator, from the model's geometry: every request's head is
checked here before its payload is allocated (transport.py asks ``payload_bytes``), and the expert ids
it carries before they index anything. Sizes come from the head's values, so a head that does not add
up (a payload of another size, a width that is not the model's, more rows than one forward can hold) is
a WorkerError of one line, never an allocation or a traceback."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from colibri_stream.experts.cluster import wire
from colibri_stream.experts.cluster.wire import Head, Op, WorkerError
from colibri_stream.planning.activations import PREFILL_CHUNK_TOKENS, PREFILL_WINDOW_CHUNKS
from colibri_stream.planning.geometry import container_args
from storage.container.reader import Container

EMPTY = (Op.STATS, Op.END_TURN, Op.SHUTDOWN)  # requests without a payload


@dataclass(frozen=True)
class RequestLimits:
    layers: frozenset[int]  # the MoE layers
    n_experts: int
    dim: int
    max_rows: int  # positions of one forward: the model's context (or a prompt window, if more)

    @classmethod
    def of(cls, container: Container) -> RequestLimits:
        args = container_args(container)
        rows = max(args.max_position_embeddings, PREFILL_CHUNK_TOKENS * PREFILL_WINDOW_CHUNKS)
        return cls(frozenset(container.moe_layers), container.n_experts, args.dim, rows)

    def payload_bytes(self, head: Head) -> int:
        """The payload ``head`` must carry; a WorkerError when its values are not this model's."""
        if head.op in EMPTY:
            expected = 0
        elif head.op == Op.REFUSE:
            return wire.MAX_TEXT_BYTES
        elif head.op == Op.PREFETCH:
            layer, count = head.values[:2]
            self._check(layer in self.layers and 0 <= count <= self.n_experts, head)
            expected = 8 * count
        elif head.op == Op.SUM:
            expected = self._sum_bytes(head)
        else:
            raise WorkerError(f"the coordinator sent {head.op.name}, not a request")
        self._check(head.payload_bytes == expected, head)
        return expected

    def _sum_bytes(self, head: Head) -> int:
        layer, rows, topk, dim, dtype, _, ahead, count, assigned = head.values[:9]
        self._check(
            layer in self.layers
            and 0 < rows <= self.max_rows
            and 0 < topk <= self.n_experts
            and dim == self.dim
            and 0 <= dtype < len(wire.DTYPES)
            and (ahead in self.layers or ahead == -1)
            and 0 <= count <= self.n_experts
            and 0 <= assigned <= self.n_experts,
            head,
        )
        return wire.payload_bytes(wire.sum_payload_specs(rows, topk, dim, wire.DTYPES[dtype], count, assigned))

    def _check(self, ok: bool, head: Head) -> None:
        if not ok:
            values = ", ".join(map(str, head.values))
            raise WorkerError(
                f"the coordinator sent a {head.op.name} request this model cannot have (values {values}; "
                f"{head.payload_bytes} B): refused"
            )

    def check_ids(self, *ids: torch.Tensor) -> None:
        for tensor in ids:
            if tensor.numel() and not (0 <= int(tensor.min()) and int(tensor.max()) < self.n_experts):
                raise WorkerError(f"the coordinator sent expert ids outside 0 .. {self.n_experts - 1}: refused")
