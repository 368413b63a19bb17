"""Optional API keys, and the session names they imply.

A request names a KV session only explicitly, with the ``X-Colibri-Session`` header (SESSION_HEADER);
OpenAI's ``user`` and Anthropic's ``metadata.user_id`` are opaque labels, never file names (a stateless
client's continuity comes from the content-addressed prefix cache). Without keys the server is
single-tenant: anyone who can reach it can use (and truncate) any session by naming it. With keys
(``serve --api-key``, or COLIBRI_API_KEYS), every /v1 request must carry one (``Authorization: Bearer
KEY`` or ``x-api-key: KEY``), and a session name names a session of *its key only*: the session's file
name is derived from a hash of the key and the name, so no name reaches another key's conversations,
and ``reused_tokens`` only ever counts the caller's own positions. The prefix cache is per key too
(``tenant_id``: the namespace of a key's blocks), unless the operator shares it (``--shared-prefix-cache``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping

from colibri_stream.errors import ColibriError
from colibri_stream.runtime.kv.prefix_cache import tenant_of_key
from colibri_stream.serve.schemas import ApiError

API_KEYS_ENV = "COLIBRI_API_KEYS"  # comma-separated, added to the --api-key flags
SESSION_HEADER = "x-colibri-session"  # the explicit KV session of a request (any route)
USER_PREFIX_CHARS = 64  # how much of the session name stays readable in a keyed session's file name


class ApiKeys:
    """The accepted keys (none: no authentication). A key is identified internally by its SHA-256,
    so the key itself is kept only for the constant-time comparison."""

    def __init__(self, keys: Iterable[str] = ()):
        self.keys = [key.encode() for key in dict.fromkeys(keys)]
        if any(not key.strip() or len(key) > 4096 for key in self.keys):
            raise ColibriError("--api-key: a key must be 1-4096 non-blank characters")

    @classmethod
    def from_sources(cls, flags: Iterable[str] | None, environ: Mapping[str, str] = os.environ) -> ApiKeys:
        """The --api-key flags plus COLIBRI_API_KEYS. The variable set but holding no key, with no flag
        either, is refused: whoever set it meant to protect the server, and it would start open."""
        from_env = [k.strip() for k in environ.get(API_KEYS_ENV, "").split(",") if k.strip()]
        keys = cls([*(flags or []), *from_env])
        if API_KEYS_ENV in environ and not keys.enabled:
            raise ColibriError(
                f"{API_KEYS_ENV} is set but holds no key, so the server would accept anyone: "
                f"give it comma-separated keys, or unset it to serve without keys"
            )
        return keys

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def authenticate(self, headers: Mapping[str, str]) -> bytes | None:
        """The caller's key, None when no keys are configured; ApiError 401 otherwise. Every key is
        compared (constant time each, no early exit), so timing says nothing about which matched."""
        if not self.keys:
            return None
        presented = _presented_key(headers)
        if presented is None:
            raise unauthorized("no API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'")
        matched = None
        for key in self.keys:
            if hmac.compare_digest(presented, key):
                matched = key
        if matched is None:
            raise unauthorized("invalid API key")
        return matched

    @staticmethod
    def session_name(key: bytes | None, user: str) -> str:
        """The KV session a request's session name (``user``) names: the name itself without keys, else a
        name only this key reaches (the readable start of the name, then 32 hex digits of SHA-256(key, name))."""
        if key is None:
            return user
        digest = hashlib.sha256(key + b"\0" + user.encode()).hexdigest()[:32]
        return f"{user[:USER_PREFIX_CHARS]}-{digest}"


def tenant_id(key: bytes | None) -> str | None:
    """Whose prefix-cache blocks a request with API key ``key`` sees (prefix_cache.tenant_of_key: a digest,
    never the key itself, is what block headers record); None without keys."""
    return None if key is None else tenant_of_key(key)


def _presented_key(headers: Mapping[str, str]) -> bytes | None:
    authorization = headers.get("authorization", "")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip().encode()
    if api_key := headers.get("x-api-key", "").strip():
        return api_key.encode()
    return None


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, "invalid_api_key", headers={"www-authenticate": "Bearer", "connection": "close"})
