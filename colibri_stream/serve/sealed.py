"""Seals: text the server hands a client and reads back later, which nobody else can forge (the
Responses API's ``reasoning.encrypted_content``; any other round trip through a client can use it).

A seal is authenticated with the server's secret key: a blob that was not made by this key, or was
changed by one bit, does not open (``SealError``; the routes answer 400). With the ``cryptography``
package installed (optional, not a dependency) the text is also encrypted (AES-256-GCM, random 96-bit
nonce); without it the seal is HMAC-SHA256 over the text, which authenticates but does not hide it (the
client already saw the text it carries back). Either kind opens on any server holding the key. A seal
is bound to its ``purpose`` (a label authenticated with it), so a blob made for one field cannot be
replayed into another.

The key: the file named by ``COLIBRI_SEAL_KEY_FILE`` (its bytes, at least 32, are the secret; share it
between servers that must read each other's seals), else ``<kv dir>/seal.key`` (made once, 32 random
bytes, mode 0600, so seals survive a restart), else, where that cannot be written, a random key for
this run only.

Blob shapes (URL-safe base64, no padding, after a version prefix):
  ``cs1g.`` nonce(12) | ciphertext | tag(16)    AES-256-GCM, associated data = purpose
  ``cs1h.`` text (UTF-8) | HMAC-SHA256(32)       over purpose | 0x00 | text
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

KEY_ENV = "COLIBRI_SEAL_KEY_FILE"
KEY_FILE = "seal.key"  # in the KV directory
KEY_BYTES = 32
MAX_BLOB_CHARS = 4 * 2**20  # a request body's limit (intake.MAX_BODY_BYTES): nothing longer can arrive
GCM, HMAC = "cs1g.", "cs1h."
NONCE_BYTES, TAG_BYTES, MAC_BYTES = 12, 16, 32


class SealError(ValueError):
    """A blob this server did not seal, or one changed since."""


class Aead(Protocol):
    """What the AES-GCM cipher offers (cryptography's AESGCM)."""

    def encrypt(self, nonce: bytes, data: bytes, associated_data: bytes | None) -> bytes: ...

    def decrypt(self, nonce: bytes, data: bytes, associated_data: bytes | None) -> bytes: ...


def _aes_gcm(key: bytes) -> Aead | None:
    """AES-256-GCM under ``key`` when cryptography is installed; None otherwise."""
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # type: ignore[import-not-found, unused-ignore]
    except ImportError:  # optional: the HMAC seal stands in
        return None
    cipher: Aead = AESGCM(key)
    return cipher


class Sealer:
    """Seals and opens text with one secret key (see the module docstring)."""

    def __init__(self, key: bytes, encrypt: bool = True):
        if len(key) < KEY_BYTES:
            raise ValueError(f"a seal key needs at least {KEY_BYTES} bytes, got {len(key)}")
        # one subkey per use of the secret: the cipher's key and the MAC's key never coincide
        self._mac_key = _subkey(key, b"hmac")
        self._aead = _aes_gcm(_subkey(key, b"aes-gcm"))
        self.encrypts = encrypt and self._aead is not None

    def seal(self, text: str, purpose: str) -> str:
        data, label = text.encode("utf-8"), purpose.encode("utf-8")
        if self.encrypts:
            assert self._aead is not None
            nonce = secrets.token_bytes(NONCE_BYTES)
            return GCM + _b64(nonce + self._aead.encrypt(nonce, data, label))
        return HMAC + _b64(data + self._mac(label, data))

    def open(self, blob: str, purpose: str) -> str:
        """The text sealed in ``blob`` for ``purpose``; SealError for anything this key did not seal."""
        label = purpose.encode("utf-8")
        if len(blob) > MAX_BLOB_CHARS:
            raise SealError("the sealed content is too long to be one this server made")
        if blob.startswith(GCM) and self._aead is not None:
            raw = _unb64(blob[len(GCM) :])
            if len(raw) < NONCE_BYTES + TAG_BYTES:
                raise SealError("the sealed content is truncated")
            try:
                data = self._aead.decrypt(raw[:NONCE_BYTES], raw[NONCE_BYTES:], label)
            except Exception:  # cryptography's InvalidTag: a forged or altered blob, or another key's
                raise SealError("the sealed content was not made by this server, or was altered") from None
            return _text(data)
        if blob.startswith(HMAC):
            raw = _unb64(blob[len(HMAC) :])
            data, mac = raw[:-MAC_BYTES], raw[-MAC_BYTES:]
            if len(raw) < MAC_BYTES or not hmac.compare_digest(mac, self._mac(label, data)):
                raise SealError("the sealed content was not made by this server, or was altered")
            return _text(data)
        raise SealError("the sealed content is not in a form this server makes")

    def _mac(self, label: bytes, data: bytes) -> bytes:
        return hmac.digest(self._mac_key, label + b"\x00" + data, "sha256")


def _subkey(key: bytes, use: bytes) -> bytes:
    return hmac.digest(key, b"colibri-seal/" + use, "sha256")


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise SealError("the sealed content is not valid base64") from None


def _text(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:  # cannot happen for a blob this key sealed
        raise SealError("the sealed content is not text") from None


def load_key(kv_dir: Path | None, env: Mapping[str, str] = os.environ) -> bytes:
    """The server's seal key (see the module docstring for where it comes from)."""
    named = env.get(KEY_ENV)
    if named:
        key = Path(named).read_bytes()
        if len(key) < KEY_BYTES:
            raise ValueError(f"{KEY_ENV}: {named} holds {len(key)} bytes; a seal key needs at least {KEY_BYTES}")
        return hashlib.sha256(key).digest() if len(key) > KEY_BYTES else key
    if kv_dir is not None:
        try:
            return _kept_key(kv_dir / KEY_FILE)
        except OSError:  # a read-only KV directory: seals last this run
            pass
    return secrets.token_bytes(KEY_BYTES)


def _kept_key(path: Path) -> bytes:
    """The key kept in ``path``, made there (0600) the first time. The new key is written whole to a
    temporary file and linked into place, which fails if another server made one meanwhile: then
    both use that one."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, secrets.token_bytes(KEY_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(temp, path)
        except FileExistsError:
            pass
        finally:
            temp.unlink()
    key = path.read_bytes()
    if len(key) != KEY_BYTES:
        raise OSError(f"{path} holds {len(key)} bytes, not a {KEY_BYTES}-byte seal key")
    return key
