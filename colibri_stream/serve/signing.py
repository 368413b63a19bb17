"""Signatures the server gives out with text a client sends back later (an Anthropic ``thinking``
block's ``signature``): an HMAC-SHA256 over the text with a per-server secret, so the server can tell
its own reasoning from a forged one and nobody without the secret can make a valid one.

The secret is kept in the KV directory (``serve-secret.key``, 32 random bytes, owner-only, written
once with O_EXCL), so signatures stay valid across restarts of the same model's server; where it
cannot be written (a read-only directory) a per-process secret is used (then a restart invalidates
earlier signatures). ``purpose`` separates uses (the same text signed for two purposes gets two
signatures): another route (the Responses API's encrypted reasoning) signs with its own purpose.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from pathlib import Path

SECRET_FILE = "serve-secret.key"
SECRET_BYTES = 32


def load_secret(directory: Path) -> bytes:
    """The directory's secret, made on first use; a fresh per-process one where that fails."""
    path = directory / SECRET_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return _read_secret(path)
    except OSError:
        return secrets.token_bytes(SECRET_BYTES)
    secret = secrets.token_bytes(SECRET_BYTES)
    try:
        os.write(fd, secret)
        os.fsync(fd)
    finally:
        os.close(fd)
    return secret


def _read_secret(path: Path) -> bytes:
    """The stored secret; a per-process one if the file is not one (a link, torn, unreadable)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return secrets.token_bytes(SECRET_BYTES)
    try:
        data = os.read(fd, SECRET_BYTES + 1)
    finally:
        os.close(fd)
    return data if len(data) == SECRET_BYTES else secrets.token_bytes(SECRET_BYTES)


class Signer:
    def __init__(self, secret: bytes):
        self.secret = secret

    def sign(self, purpose: str, text: str) -> str:
        """URL-safe base64 of HMAC-SHA256(secret, purpose NUL text)."""
        mac = hmac.new(self.secret, purpose.encode() + b"\0" + text.encode("utf-8", "surrogatepass"), hashlib.sha256)
        return base64.urlsafe_b64encode(mac.digest()).decode().rstrip("=")

    def verify(self, purpose: str, text: str, signature: str) -> bool:
        return hmac.compare_digest(self.sign(purpose, text).encode(), signature.encode("utf-8", "surrogatepass"))
