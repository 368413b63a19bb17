"""Where colibri-stream keeps per-user files: $XDG_CACHE_HOME/colibri-stream (default ~/.cache/...)."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir(*parts: str) -> Path:
    """``user_cache_dir("kv", "ab12")`` -> ~/.cache/colibri-stream/kv/ab12 (nothing is created)."""
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache_home.joinpath("colibri-stream", *parts)
