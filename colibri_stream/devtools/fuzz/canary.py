"""Files outside every case's inputs that hostile inputs point at (absolute paths, ``../``, symlinks),
watched with inotify: a read the audit hook cannot see (safetensors and tokenizers open files from
Rust) still shows up as an open of a canary. Linux only; elsewhere ``CanaryWatch.touched`` is empty
and the audit hook alone judges containment."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import struct
from pathlib import Path

_IN_ACCESS, _IN_OPEN, _IN_NONBLOCK = 0x1, 0x20, 0x800
_EVENT = struct.Struct("iIII")


def plant(root: Path) -> Path:
    """The canary directory: a copy-worthy file of each kind the surfaces name, and a directory."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "canary").write_bytes(b"canary: a file outside the inputs\n")
    (root / "canary.json").write_text('{"canary": true}\n')
    header = b'{"canary":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    (root / "canary.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0\0\0\0")
    (root / "canary.d").mkdir(exist_ok=True)
    return root / "canary"


class CanaryWatch:
    def __init__(self, directory: Path):
        self.directory = directory
        self._fd = -1
        libc_name = ctypes.util.find_library("c")
        if not libc_name:
            return
        libc = ctypes.CDLL(libc_name, use_errno=True)
        fd = libc.inotify_init1(_IN_NONBLOCK)
        if fd < 0:
            return
        watched = [libc.inotify_add_watch(fd, os.fsencode(p), _IN_OPEN | _IN_ACCESS) for p in self._paths()]
        if all(w < 0 for w in watched):
            os.close(fd)
            return
        self._fd = fd

    def _paths(self) -> list[Path]:
        return [self.directory, *self.directory.iterdir()]

    def touched(self) -> bool:
        """Whether anything opened or read a canary since the last call."""
        if self._fd < 0:
            return False
        seen = False
        while True:
            try:
                data = os.read(self._fd, 65536)
            except BlockingIOError:
                return seen
            seen = seen or len(data) >= _EVENT.size

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
