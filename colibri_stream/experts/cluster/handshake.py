"""The cluster-key handshake on a fresh link (auth.py says what it proves), one function per side. Either
side ends it with a WorkerError of one line: a peer without the key, with another key, speaking an older
protocol (no handshake) or not colibri-stream at all; on success the link is sealed."""

from __future__ import annotations

from colibri_stream.experts.cluster import auth, wire
from colibri_stream.experts.cluster.auth import COORDINATOR_ROLE, NONCE_BYTES, PROOF_BYTES, WORKER_ROLE, Seal
from colibri_stream.experts.cluster.members import refuse
from colibri_stream.experts.cluster.transport import Link
from colibri_stream.experts.cluster.wire import Op, WorkerError

HANDSHAKE = "the cluster key handshake"


def prove_to_coordinator(link: Link, key: bytes, timeout_s: float, where: str) -> None:
    """The worker's side: send a nonce, check the coordinator's proof, send its own; ``where`` names the
    coordinator's address in the errors."""
    mine = auth.nonce()
    link.send(Op.AUTH, [mine], (wire.PROTOCOL_VERSION,), timeout_s)
    head, payload = link.receive(timeout_s, HANDSHAKE, wire.MAX_TEXT_BYTES)
    if head.op == Op.REFUSE:
        raise WorkerError(f"the coordinator at {where} refused this worker: {payload.decode(errors='replace')}")
    if head.op != Op.AUTH or len(payload) != NONCE_BYTES + PROOF_BYTES:
        raise WorkerError(
            f"{where} answered the cluster key handshake with {head.op.name} ({len(payload)} B): not a colibri-stream "
            f"coordinator of protocol {wire.PROTOCOL_VERSION}"
        )
    theirs, their_proof = bytes(payload[:NONCE_BYTES]), payload[NONCE_BYTES:]
    link.send(Op.AUTH, [auth.proof(key, WORKER_ROLE, mine, theirs)], (), timeout_s)  # before the check: a wrong
    if not auth.proves(key, COORDINATOR_ROLE, mine, theirs, their_proof):  # key is refused on both sides
        raise WorkerError(
            f"the coordinator at {where} does not hold this worker's cluster key: give both the same key "
            f"(--cluster-key-file or {auth.KEY_ENV}), or this is not your cluster's coordinator"
        )
    link.seal = Seal.for_side(key, WORKER_ROLE, mine, theirs)


def check_worker(link: Link, key: bytes, timeout_s: float) -> None:
    """The coordinator's side: a connection's first frame must open the handshake, its proof must hold."""
    head, payload = link.receive(timeout_s, HANDSHAKE, wire.MAX_TEXT_BYTES)
    if head.op != Op.AUTH or len(payload) != NONCE_BYTES:
        refuse(link, f"this coordinator requires the cluster key handshake (protocol {wire.PROTOCOL_VERSION})")
        raise WorkerError(
            f"{link.name}: sent {head.op.name} without the cluster key handshake (an older colibri-stream, "
            "or another program): refused"
        )
    if head.values[0] != wire.PROTOCOL_VERSION:
        refuse(link, f"this coordinator speaks protocol {wire.PROTOCOL_VERSION}, the worker {head.values[0]}")
        raise WorkerError(f"{link.name} speaks protocol {head.values[0]}, this coordinator {wire.PROTOCOL_VERSION}")
    theirs, mine = bytes(payload), auth.nonce()
    link.send(Op.AUTH, [mine, auth.proof(key, COORDINATOR_ROLE, theirs, mine)], (), timeout_s)
    head, payload = link.receive(timeout_s, HANDSHAKE, PROOF_BYTES)
    if head.op != Op.AUTH or not auth.proves(key, WORKER_ROLE, theirs, mine, payload):
        refuse(link, "it does not hold this coordinator's cluster key")
        raise WorkerError(f"{link.name}: refused, it does not hold this coordinator's cluster key")
    link.seal = Seal.for_side(key, COORDINATOR_ROLE, theirs, mine)
