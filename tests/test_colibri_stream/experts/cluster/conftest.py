"""The cluster key of this test run: the default key file in the run's private user cache (tests/conftest.py
points XDG_CACHE_HOME there), made before any worker starts (a hand-started worker may start before its
coordinator, which would otherwise create it)."""

from __future__ import annotations

import pytest

from colibri_stream.experts.cluster.auth import load_key


@pytest.fixture(scope="session", autouse=True)
def cluster_key(private_user_cache) -> bytes:
    return load_key(None, create=True)
