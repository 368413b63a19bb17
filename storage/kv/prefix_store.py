"""Prefix-cache blocks by key in two tiers: RAM and a directory, each least-recently-used by bytes.

A block found on disk is copied up to RAM; a new block goes to both. Each tier evicts its least recently
used blocks until it is within its byte budget ("full" is never an error: a cache drops, it does not
refuse). A budget of 0 turns a tier off. The directory is shared: several processes (a server and a
`run`) may read and write it at once. A block is looked up by its file name whatever this process's
index holds, so one process's blocks serve another's requests; the disk budget is kept by each
process over the blocks it knows (those it found at open, read or wrote), so it holds per process.

A file under a block's name that fails the checks (damaged, torn, or not that key's block of this
namespace: prefix_blocks.read_block) is a miss and is removed, so the block is recomputed and written
again; the directory is the cache's own. The layout and checks are prefix_blocks.py's.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from storage.errors import (
    CorruptDataError,
    FormatError,
    IncompatibleStateError,
    StorageError,
    write_errors,
)
from storage.kv.prefix_blocks import BLOCK_SUFFIX, Block, Namespace, read_block, write_block

# A key is a hex digest (the app's); anything else could name a path outside the directory.
_KEY_CHARACTERS = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class PrefixConfig:
    """How the prefix cache is sized. These field defaults are the only ones: budget files and flags take
    theirs from here."""

    # RAM for recently used blocks: an agent's preamble read back without touching the disk
    ram_bytes: int = 512 << 20
    # blocks kept in the KV directory across restarts: a 4k-token preamble of DeepSeek-V3 is ~0.6 GB
    # in float32 records, so this holds a dozen of them
    disk_bytes: int = 8 << 30
    enabled: bool = True
    # with API keys, every key's prefixes are its own (another key's blocks are not found); shared: one
    # namespace for all keys, for one user's several keys (an operator's choice: a key then learns, from
    # cached tokens or timing, what other keys' prompts began with)
    shared: bool = False


@dataclass(frozen=True)
class PrefixUsage:
    ram_blocks: int
    ram_bytes: int
    disk_blocks: int
    disk_bytes: int


def check_key(key: str) -> str:
    if not key or len(key) > 128 or not set(key) <= _KEY_CHARACTERS:
        raise ValueError(f"prefix-cache key {key!r} is not a lowercase hex digest")
    return key


class PrefixStore:
    """Blocks of one namespace in RAM (``ram_bytes``) and in ``directory`` (``disk_bytes``; None: RAM only)."""

    def __init__(self, namespace: Namespace, directory: Path | None, ram_bytes: int, disk_bytes: int):
        self.namespace = namespace
        self.directory = directory if disk_bytes > 0 else None
        self.ram_budget, self.disk_budget = ram_bytes, disk_bytes
        self._ram: OrderedDict[str, Block] = OrderedDict()
        self._ram_bytes = 0
        self._disk: OrderedDict[str, int] = OrderedDict()  # key -> file bytes, least recently used first
        self._disk_bytes = 0
        self._checked: set[str] = set()  # keys whose file this process wrote, or read and checked
        if self.directory is not None:
            self._index_directory(self.directory)

    def _index_directory(self, directory: Path) -> None:
        """Know the blocks already there, oldest use (mtime) first: what a restart evicts first. The
        directory is made by the first block written (a run that computes nothing leaves nothing)."""
        if directory.is_symlink() or (os.path.lexists(directory) and not directory.is_dir()):
            raise FormatError(
                f"{directory}: the prefix-cache directory is not a directory of its own (a link is never "
                "followed out of the KV directory); remove it"
            )
        found = []
        for entry in os.scandir(directory) if directory.is_dir() else ():
            key = entry.name.removesuffix(BLOCK_SUFFIX)
            if (
                entry.name.endswith(BLOCK_SUFFIX)
                and set(key) <= _KEY_CHARACTERS
                and entry.is_file(follow_symlinks=False)
            ):
                status = entry.stat(follow_symlinks=False)
                found.append((status.st_mtime_ns, key, status.st_size))
        for _, key, size in sorted(found):
            self._disk[key] = size
            self._disk_bytes += size

    def path_of(self, key: str) -> Path:
        assert self.directory is not None
        return self.directory / f"{check_key(key)}{BLOCK_SUFFIX}"

    # ------------------------------------------------------------------------------------ verbs
    def get(self, key: str) -> tuple[Block, str] | None:
        """(the block, the tier it came from: "ram" or "disk"), or None."""
        block = self._ram.get(check_key(key))
        if block is not None:
            self._ram.move_to_end(key)
            return block, "ram"
        if self.directory is None:
            return None
        block = self._read(key)
        if block is None:
            return None
        self._keep_in_ram(key, block)
        return block, "disk"

    def contains(self, key: str) -> bool:
        """Whether ``key`` is held: in RAM, or on disk as a block this process wrote or read and checked
        (a file merely found there may be damaged: its block is written again rather than trusted)."""
        return check_key(key) in self._ram or key in self._checked

    def put(self, key: str, block: Block) -> None:
        """Hold ``block`` in both tiers. A disk that refuses it (full, failing, read-only) drops the disk
        copy, never the turn (the RAM one still serves); a block larger than a tier's budget is not held
        there."""
        self._keep_in_ram(check_key(key), block)
        if self.directory is None or key in self._checked:
            return
        try:
            with write_errors(self.directory, "the prefix-cache directory"):
                self.directory.mkdir(parents=True, exist_ok=True)
            size = write_block(self.path_of(key), self.namespace, key, block)
        except (OSError, StorageError):  # a full or failing disk, a read-only directory: RAM still serves
            return
        self._note_on_disk(key, size)
        self._checked.add(key)

    @staticmethod
    def clear_directory(directory: Path) -> int:
        """Delete every block file in ``directory`` (whatever its namespace; a link is left alone);
        returns how many. A process holding blocks in RAM keeps serving them until it ends."""
        removed = 0
        for path in directory.glob(f"*{BLOCK_SUFFIX}") if directory.is_dir() else []:
            if not path.is_symlink():
                path.unlink(missing_ok=True)
                removed += 1
        return removed

    def usage(self) -> PrefixUsage:
        return PrefixUsage(len(self._ram), self._ram_bytes, len(self._disk), self._disk_bytes)

    # --------------------------------------------------------------------------------- internals
    def _read(self, key: str) -> Block | None:
        path = self.path_of(key)
        try:
            block = read_block(path, self.namespace, key)
        except FileNotFoundError:
            self._forget_on_disk(key)
            return None
        except (FormatError, CorruptDataError, IncompatibleStateError):
            # torn by a power cut, damaged, or not this key's block: the directory is the cache's own and
            # a block's name is its key, so whatever is there is removed, and the block recomputed
            path.unlink(missing_ok=True)
            self._forget_on_disk(key)
            return None
        try:
            os.utime(path)  # its last use: the order a restart evicts in
        except OSError:
            pass
        self._note_on_disk(key, path.stat().st_size if path.exists() else 0)
        self._checked.add(key)
        return block

    def _keep_in_ram(self, key: str, block: Block) -> None:
        if block.nbytes > self.ram_budget:
            return
        old = self._ram.pop(key, None)
        self._ram_bytes -= old.nbytes if old is not None else 0
        self._ram[key] = block
        self._ram_bytes += block.nbytes
        while self._ram_bytes > self.ram_budget:
            _, dropped = self._ram.popitem(last=False)
            self._ram_bytes -= dropped.nbytes

    def _note_on_disk(self, key: str, size: int) -> None:
        self._forget_on_disk(key)
        self._disk[key] = size
        self._disk_bytes += size
        while self._disk_bytes > self.disk_budget and self._disk:
            oldest, oldest_size = self._disk.popitem(last=False)
            self._disk_bytes -= oldest_size
            self._checked.discard(oldest)
            self.path_of(oldest).unlink(missing_ok=True)

    def _forget_on_disk(self, key: str) -> None:
        self._checked.discard(key)
        size = self._disk.pop(key, None)
        if size is not None:
            self._disk_bytes -= size
