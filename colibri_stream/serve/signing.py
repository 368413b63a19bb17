"""Signatures the server gives out with text a client sends back later (an Anthropic ``thinking``
block's ``signature``): an HMAC-SHA256 over the text with a per-server secret, so the server can tell
its own reasoning from a forged one and nobody without the secret can make a valid one.

The secret is the server's seal key (serve/sealed.py ``load_key``: ``COLIBRI_SEAL_KEY_FILE``, else kept in
the KV directory, so signatures stay valid across restarts), one secret for every round trip through a
client. ``purpose`` separates uses (the same text signed for two purposes gets two signatures), and a
signature is made with a key derived for signing, never the sealing key itself.
"""

from __future__ import annotations

import base64
import hashlib
import hmac


class Signer:
    def __init__(self, key: bytes):
        self.secret = hmac.new(key, b"colibri-stream signatures", hashlib.sha256).digest()

    def sign(self, purpose: str, text: str) -> str:
        """URL-safe base64 of HMAC-SHA256(secret, purpose NUL text)."""
        mac = hmac.new(self.secret, purpose.encode() + b"\0" + text.encode("utf-8", "surrogatepass"), hashlib.sha256)
        return base64.urlsafe_b64encode(mac.digest()).decode().rstrip("=")

    def verify(self, purpose: str, text: str, signature: str) -> bool:
        return hmac.compare_digest(self.sign(purpose, text).encode(), signature.encode("utf-8", "surrogatepass"))
