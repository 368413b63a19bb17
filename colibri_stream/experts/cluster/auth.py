"""The cluster key and what it proves: only processes that hold it take part in a cluster, both ways.

A link starts with a challenge-response handshake (plain frames, wire.py AUTH) before any other frame:

    worker -> coordinator   AUTH  protocol; payload: the worker's nonce (32 B)
    coordinator -> worker   AUTH  payload: the coordinator's nonce (32 B) | its proof (32 B)
    worker -> coordinator   AUTH  payload: the worker's proof (32 B)

A proof is HMAC-SHA256(key, role | worker nonce | coordinator nonce): the coordinator proves it holds
the key to the worker (a worker never serves whoever bound the port first) and the worker proves it to
the coordinator. Each side sends its proof before it checks the other's, so a wrong key is refused on
both sides in one line. Every frame after it is sealed (transport.py): one tag after its payload, over
head and payload, checked before the frame is used; the tags are AES-GCM's (Seal) under a key per
direction derived from the key and both nonces, over a frame counter, so a frame cannot be forged,
replayed, reordered or reflected. The frames are not encrypted:
the key gives authenticity, not confidentiality (README, "Workers on other machines").

The key is 64 hex digits (256 bits) of text: --cluster-key-file FILE, else COLIBRI_CLUSTER_KEY, else
``$XDG_CACHE_HOME/colibri-stream/cluster.key``, which a coordinator creates (mode 0600) when it is
missing. Local workers get it in their environment (never on a command line: ``ps`` shows those to
every user).
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import stat
from collections.abc import Sequence
from pathlib import Path

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from colibri_stream.errors import ColibriError
from colibri_stream.experts.cluster.wire import TAG_BYTES  # AES-GCM's full tag: 128 bits a frame
from colibri_stream.paths import user_cache_dir

logger = logging.getLogger(__name__)

KEY_ENV = "COLIBRI_CLUSTER_KEY"
KEY_FILE_NAME = "cluster.key"
KEY_FILE_HINT = "~/.cache/colibri-stream/cluster.key"  # the default file, for --help ($XDG_CACHE_HOME if set)
MIN_KEY_CHARS = 32  # 128 bits of hex at least
NONCE_BYTES = 32
PROOF_BYTES = 32
Buffer = bytes | bytearray | memoryview


class ClusterKeyError(ColibriError):
    """No cluster key, or one that cannot be used (too short, a file other users can read)."""


def default_key_path() -> Path:
    return user_cache_dir(KEY_FILE_NAME)


def load_key(key_file: str | Path | None, create: bool) -> bytes:
    """The cluster key: ``key_file``, else $COLIBRI_CLUSTER_KEY, else the default file (created by a
    coordinator, ``create``, when missing)."""
    if key_file is not None:
        return _read_key_file(Path(key_file), "--cluster-key-file")
    text = os.environ.get(KEY_ENV)
    if text is not None:
        return _checked(text.strip(), KEY_ENV)
    path = default_key_path()
    if not path.exists() and create:
        _create_key_file(path)
    if not path.exists():
        raise ClusterKeyError(
            f"no cluster key: copy the coordinator's {path} to this machine and give --cluster-key-file FILE "
            f"(or set {KEY_ENV})"
        )
    return _read_key_file(path, "the cluster key file")


def new_key_text() -> str:
    return secrets.token_hex(32)


def _create_key_file(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return  # another coordinator made it first: read theirs
    except OSError as exc:
        raise ClusterKeyError(f"cannot create the cluster key {path} ({exc.strerror or exc})") from None
    with os.fdopen(fd, "w") as out:
        out.write(new_key_text() + "\n")
    logger.warning("cluster key created in %s: workers on other machines need a copy (--cluster-key-file)", path)


def _read_key_file(path: Path, what: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise ClusterKeyError(f"{what} {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ClusterKeyError(f"{what} {path}: not a regular file")
        if info.st_mode & 0o077:
            raise ClusterKeyError(
                f"{what} {path} can be read by other users (mode {info.st_mode & 0o777:o}): chmod 600 it"
            )
        raw = handle.read(4097)
    if len(raw) > 4096:
        raise ClusterKeyError(f"{what} {path}: more than 4096 bytes, not a cluster key")
    return _checked(raw.decode(errors="replace").strip(), f"{what} {path}")


def _checked(text: str, where: str) -> bytes:
    if len(text) < MIN_KEY_CHARS or not text.isprintable():
        raise ClusterKeyError(
            f"{where}: a cluster key is at least {MIN_KEY_CHARS} printable characters (64 hex digits)"
        )
    return text.encode()


# ---------------------------------------------------------------------------------- handshake
def nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def proof(key: bytes, role: bytes, worker_nonce: bytes, coordinator_nonce: bytes) -> bytes:
    return hmac.digest(key, b"colibri-stream proof " + role + worker_nonce + coordinator_nonce, "sha256")


def proves(key: bytes, role: bytes, worker_nonce: bytes, coordinator_nonce: bytes, given: Buffer) -> bool:
    return hmac.compare_digest(proof(key, role, worker_nonce, coordinator_nonce), bytes(given))


COORDINATOR_ROLE, WORKER_ROLE = b"coordinator", b"worker"


class Seal:
    """A link's per-direction frame tags after the handshake (transport.py calls it for every frame).

    A frame's tag is AES-256-GCM's with the head as the text and the payload as associated data: one
    call covers both (the head's ciphertext is thrown away; only the tag travels), ~5 GB/s on a reply of
    57 KB. The key is per direction and new per link (the handshake's nonces), the nonce is the frame's
    counter, so no nonce repeats under a key and a frame cannot be forged, replayed, reordered or
    reflected. A head is used before its tag is checked only to size the payload, and that size is first
    held to what the receiver allows at that step (transport.py): a forged head costs at most what an
    honest frame may, then ends the link."""

    def __init__(self, send_key: bytes, recv_key: bytes):
        self._send, self._recv = AESGCM(send_key), AESGCM(recv_key)
        self.sent = 0  # frames sealed so far: the counter in the next tag
        self.received = 0

    @classmethod
    def for_side(cls, key: bytes, role: bytes, worker_nonce: bytes, coordinator_nonce: bytes) -> Seal:
        nonces = worker_nonce + coordinator_nonce
        to_worker = hmac.digest(key, b"colibri-stream to worker " + nonces, "sha256")
        to_coordinator = hmac.digest(key, b"colibri-stream to coordinator " + nonces, "sha256")
        if role == COORDINATOR_ROLE:
            return cls(to_worker, to_coordinator)
        return cls(to_coordinator, to_worker)

    def seal(self, head: Buffer, parts: Sequence[memoryview]) -> bytes:
        """The tag of the next frame sent (``head`` and its payload ``parts``)."""
        count, self.sent = self.sent, self.sent + 1
        payload = parts[0] if len(parts) == 1 else b"".join(parts)  # a request's few parts: ~14 KB copied
        return _tag(self._send, count, head, payload)

    def frame_ok(self, head: Buffer, payload: Buffer, tag: Buffer) -> bool:
        """Whether the next frame received carries its tag; it counts as received either way (a bad tag
        ends the link)."""
        count, self.received = self.received, self.received + 1
        return hmac.compare_digest(_tag(self._recv, count, head, payload), tag)


def _tag(aead: AESGCM, count: int, head: Buffer, payload: Buffer) -> bytes:
    return aead.encrypt(count.to_bytes(12, "little"), head, payload)[-TAG_BYTES:]
