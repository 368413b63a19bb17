"""Real failing and full disks for the fault tests and the fuzz surfaces (root only; each says why not).

``LoopDisk``: ext4 on a loop device over a sparse file, mounted in a directory. ``fail()`` makes the
device fail every write from then on (the loop device's size limit is cut to its first MiB: the block
layer answers every write past it with an I/O error, ext4 reports EIO to the writer, then aborts its
journal and goes read-only: EROFS), which is what a dying disk or a yanked USB stick does under a
mounted filesystem; ``heal()`` unmounts, gives the device back its size and mounts it again, so a test
reads what really reached the disk. No device-mapper needed (many kernels, this CI's included, lack
it): ``dmsetup`` with an ``error`` table would do the same.

``Tmpfs``: a small tmpfs mounted for a run (a full disk: ENOSPC).

Both clean up in ``close()`` (also as context managers): unmount (lazily if busy), detach, remove.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType

LOOP_SET_STATUS64, LOOP_GET_STATUS64 = 0x4C04, 0x4C05
# struct loop_info64 (linux/loop.h): device, inode, rdevice, offset, sizelimit, number, encrypt type,
# encrypt key size, flags, file name, crypt name, encrypt key, init[2]
_LOOP_INFO64 = struct.Struct("=QQQQQIIII64s64s32s2Q")
_SIZELIMIT = 4
FAIL_LIMIT_BYTES = 1 << 20  # what stays readable and writable of a failed device: its first MiB
_TOOLS = ("losetup", "mkfs.ext4", "mount", "umount")


class DiskUnavailable(RuntimeError):
    """This machine cannot make the disk (not root, no tools, no loop devices); the message says why."""


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise DiskUnavailable(f"{' '.join(argv)}: {done.stderr.strip() or f'exit {done.returncode}'}")
    return done.stdout.strip()


def _needs_root(tools: tuple[str, ...]) -> None:
    if os.geteuid() != 0:
        raise DiskUnavailable("needs root (loop devices and mounts)")
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        raise DiskUnavailable(f"needs {', '.join(missing)} on PATH")


def set_loop_size_limit(device: str, limit: int) -> None:
    """Cut (or with 0, restore) what a loop device exposes of its file, under a mounted filesystem."""
    fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
    try:
        info = bytearray(_LOOP_INFO64.size)
        fcntl.ioctl(fd, LOOP_GET_STATUS64, info)
        fields = list(_LOOP_INFO64.unpack(info))
        fields[_SIZELIMIT] = limit
        fcntl.ioctl(fd, LOOP_SET_STATUS64, _LOOP_INFO64.pack(*fields))
    finally:
        os.close(fd)


def _unmount(where: Path) -> None:
    if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)  # a process still in it


class LoopDisk:
    """ext4 of ``size`` bytes on a loop device, mounted at ``self.path`` (see the module doc)."""

    def __init__(self, size: int = 64 << 20, parent: str | Path | None = None):
        _needs_root(_TOOLS)
        self.root = Path(tempfile.mkdtemp(prefix="colibri-loopdisk-", dir=parent))
        self.image, self.path = self.root / "disk.img", self.root / "mnt"
        self.device: str | None = None
        self.mounted = False
        try:
            with open(self.image, "wb") as f:
                f.truncate(size)  # sparse: only what ext4 writes takes space
            self.device = _run("losetup", "--find", "--show", str(self.image))
            _run("mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", self.device)
            self.path.mkdir()
            self._mount()
        except BaseException:
            self.close()
            raise

    def _mount(self) -> None:
        assert self.device is not None
        _run("mount", "-t", "ext4", self.device, str(self.path))
        self.mounted = True

    def fail(self) -> None:
        """From now on the device fails every write (and every read not already cached). What was written
        before is on the device first: left to writeback, a busy machine's late journal commit failed instead
        and ext4 went read-only before the write under test was tried (EROFS in place of its own error)."""
        assert self.device is not None
        os.sync()
        set_loop_size_limit(self.device, FAIL_LIMIT_BYTES)

    def heal(self) -> None:
        """Unmount the (failed) filesystem, give the device its size back, mount it again: what reached the
        disk before the failure is what the directory now holds."""
        assert self.device is not None
        if self.mounted:
            _unmount(self.path)
            self.mounted = False
        set_loop_size_limit(self.device, 0)
        self._mount()

    def close(self) -> None:
        if self.mounted:
            _unmount(self.path)
            self.mounted = False
        if self.device is not None:
            subprocess.run(["losetup", "-d", self.device], capture_output=True)
            self.device = None
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> LoopDisk:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class Tmpfs:
    """A tmpfs of ``size`` (mount's syntax: "2m") mounted at ``self.path``: a disk that fills up."""

    def __init__(self, size: str, parent: str | Path | None = None):
        _needs_root(("mount", "umount"))
        self.path = Path(tempfile.mkdtemp(prefix="colibri-tmpfs-", dir=parent))
        self.mounted = False
        try:
            _run("mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(self.path))
            self.mounted = True
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.mounted:
            _unmount(self.path)
            self.mounted = False
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> Tmpfs:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
