"""Typed errors at the storage boundary; the CLI prints each as one line."""

from __future__ import annotations


class StorageError(Exception):
    """Base of every error storage raises on bad input."""


class FormatError(StorageError):
    """A file or store that is not in the expected format (structure, metadata, version, shapes)."""


class CorruptDataError(StorageError):
    """Bytes that fail their checksum or are shorter than the metadata says."""


class IncompatibleStateError(StorageError):
    """State written for another model, source or geometry."""


class BudgetError(StorageError):
    """A memory budget that cannot work: below the minimum, above the machine, or exhausted."""
