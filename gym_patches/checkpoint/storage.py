"""The storage seam of every checkpoint file, both sides: a ``StorageWriter`` and a ``StorageReader``.

Shaped like ``torch.distributed.checkpoint``'s writer and reader roles
(docs/design.md §5.4, §4.7): a store decides *what* goes where (names, temp files,
manifests, renames); the writer and the reader only move one file's bytes.
The stores take them as arguments (Gym's ``gym_patches.checkpoint.store``, RL's
``nemo_rl.utils.snapshot_store`` and the run store built on it), so a test
hands a store a writer that fails like a full disk; this is the one definition,
RL imports it (Gym never imports RL).

A store called without a writer uses this process's default
(``process_writer``): plain files, unless something that starts the process
installed another (``use_process_writer``) for the code that does not pass one
down (a trainer's save, a Gym server's persist).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import IO


class StorageWriter(ABC):
    """Writes one file's bytes, durably: after ``write`` returns they are on disk (fsynced)."""

    @abstractmethod
    def write(self, path: Path, data: bytes) -> None:
        """Create or truncate ``path`` and write ``data``; an ``OSError`` says why it could not."""


class StorageReader(ABC):
    """Reads one file's bytes back."""

    @abstractmethod
    def read_bytes(self, path: Path) -> bytes:
        """All of ``path``; ``FileNotFoundError`` / ``OSError`` as the file system says."""

    @abstractmethod
    def open(self, path: Path) -> IO[bytes]:
        """``path`` opened for reading in binary, for files read in chunks or line by line."""


class FileSystemWriter(StorageWriter):
    """The default: plain files (create/truncate, write, flush, fsync)."""

    def write(self, path: Path, data: bytes) -> None:
        with open(path, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())


class FileSystemReader(StorageReader):
    """The default: plain files."""

    def read_bytes(self, path: Path) -> bytes:
        return Path(path).read_bytes()

    def open(self, path: Path) -> IO[bytes]:
        return open(path, "rb")


_process_writer: StorageWriter = FileSystemWriter()


def process_writer() -> StorageWriter:
    """The writer of a store that was given none (plain files unless ``use_process_writer`` changed it)."""
    return _process_writer


def use_process_writer(writer: StorageWriter) -> StorageWriter:
    """Make ``writer`` this process's default; returns the previous one (install it again to undo)."""
    global _process_writer
    if not isinstance(writer, StorageWriter):
        raise TypeError(f"writer must be a StorageWriter, got {type(writer).__name__}")
    previous, _process_writer = _process_writer, writer
    return previous
