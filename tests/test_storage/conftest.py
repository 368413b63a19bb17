"""The platform features under the storage tests (storage/files/io_features.py).

A test that uses the ``io_features`` fixture (as an argument or by ``@pytest.mark.usefixtures``) runs in
two modes unless it names its own:

    platform    the host as it is (here: Linux, O_DIRECT, fadvise, cgroups, /proc)
    forced-off  COLIBRI_STREAM_IO_FEATURES=-o_direct,-fadvise,-cgroups,-proc: the fallbacks an OS without
                them takes; afterwards the fixture fails the test if any descriptor was opened with O_DIRECT
                or posix_fadvise was called
    f_nocache   macOS as far as Linux can play it, named explicitly: os.O_DIRECT and os.posix_fadvise
                removed, cgroups and /proc off, and a stand-in F_NOCACHE whose fcntl calls are recorded (and
                checked to name an open descriptor) instead of reaching a kernel without it; the same checks

Which tests opt in is chosen for the reads and writes they exercise at a modest cost (the forced-off runs
add well under a minute); the exhaustive truncation and kill -9 loops stay single.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from storage.files.io_features import IO_FEATURES_ENV
from storage.files.page_cache import Bypass, platform_bypass

FORCED_OFF = "-o_direct,-fadvise,-cgroups,-proc"
DEFAULT_MODES = ("platform", "forced-off")
O_DIRECT = getattr(os, "O_DIRECT", 0)  # the host's, kept before a mode removes it
F_NOCACHE_STAND_IN = 48  # macOS's number; Linux's fcntl never sees it (the stand-in answers)


@dataclass
class IOMode:
    name: str
    bypass: Bypass = Bypass.NONE  # platform_bypass() in this mode
    o_direct_opens: int = 0
    fadvise_calls: int = 0
    nocache_fds: list[int] = field(default_factory=list)  # descriptors the stand-in F_NOCACHE was set on

    @property
    def fallback(self) -> bool:
        return self.name != "platform"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    named = any("io_features" in str(m.args[0]) for m in metafunc.definition.iter_markers("parametrize"))
    if "io_features" in metafunc.fixturenames and not named:
        metafunc.parametrize("io_features", DEFAULT_MODES, indirect=True)


@pytest.fixture
def io_features(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[IOMode]:
    mode = IOMode(request.param)
    monkeypatch.delenv(IO_FEATURES_ENV, raising=False)
    if mode.name == "forced-off":
        monkeypatch.setenv(IO_FEATURES_ENV, FORCED_OFF)
    elif mode.name == "f_nocache":
        monkeypatch.setenv(IO_FEATURES_ENV, "-cgroups,-proc")
        monkeypatch.delattr(os, "O_DIRECT", raising=False)
        monkeypatch.delattr(os, "posix_fadvise", raising=False)
        _stand_in_nocache(monkeypatch, mode)
    if mode.fallback:
        _spy_on_opens_and_fadvise(monkeypatch, mode)
    mode.bypass = platform_bypass()
    yield mode
    if mode.fallback:
        assert mode.o_direct_opens == 0, f"{mode.o_direct_opens} descriptors opened with O_DIRECT"
        assert mode.fadvise_calls == 0, f"posix_fadvise called {mode.fadvise_calls} times"


def _spy_on_opens_and_fadvise(monkeypatch: pytest.MonkeyPatch, mode: IOMode) -> None:
    real_open = os.open

    def counting_open(path, flags, *args, **kwargs):
        if flags & O_DIRECT:
            mode.o_direct_opens += 1
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", counting_open)
    if hasattr(os, "posix_fadvise"):
        real_fadvise = os.posix_fadvise

        def counting_fadvise(*args):
            mode.fadvise_calls += 1
            return real_fadvise(*args)

        monkeypatch.setattr(os, "posix_fadvise", counting_fadvise)


def _stand_in_nocache(monkeypatch: pytest.MonkeyPatch, mode: IOMode) -> None:
    real_fcntl = fcntl.fcntl

    def fcntl_with_nocache(fd, command, arg=0):
        if command != F_NOCACHE_STAND_IN:
            return real_fcntl(fd, command, arg)
        os.fstat(fd)  # an open descriptor, as the real call requires (EBADF otherwise)
        assert arg == 1, arg
        mode.nocache_fds.append(fd)
        return 0

    monkeypatch.setattr(fcntl, "F_NOCACHE", F_NOCACHE_STAND_IN, raising=False)
    monkeypatch.setattr(fcntl, "fcntl", fcntl_with_nocache)
