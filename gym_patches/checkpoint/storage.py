"""The storage seam of every checkpoint file, both sides: a ``StorageWriter`` and a ``StorageReader``.

Shaped like ``torch.distributed.checkpoint``'s writer and reader roles
(docs/design.md §5.4, §4.7): a store decides *what* goes where (names, temp files,
manifests, renames); the writer and the reader only move one file's bytes.
The stores take them as arguments (Gym's ``gym_patches.checkpoint.store``, RL's
``nemo_rl.utils.snapshot_store`` and the run store built on it), so a test
hands a store a writer that fails like a full disk; this is the one definition,
RL imports it (Gym never imports RL).

A store called without a writer uses this process's default
(``process_writer``): plain files, unless the run's config names another
(``StorageWriterSpec``: RL's ``checkpointing.storage_writer``, handed to each Gym
server as ``checkpoint.storage_writer``), which the driver and every Gym server
install at startup (``install_writer``) for the code that does not pass one down
(a trainer's save, a Gym server's persist). Each process builds its own instance.
"""

from __future__ import annotations

import importlib
import os
import re
from abc import ABC, abstractmethod
from pathlib import Path
from typing import IO, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


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


_CLASS_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class StorageWriterSpec(BaseModel):
    """A ``StorageWriter`` class named in a config (``package.module:ClassName``) and its keyword
    arguments: how a run writes its checkpoint files through something other than plain files (an
    object store's writer, or a test's writer that fails like a full disk), in every process.

    Validating the spec builds one writer and drops it, so a bad argument is refused with the config
    (a writer's constructor should be cheap and connect to nothing until its first write)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    class_path: str
    kwargs: dict[str, Any] = Field(default_factory=dict)

    @field_validator("class_path")
    @classmethod
    def _importable_writer(cls, value: str) -> str:
        if not _CLASS_PATH.match(value):
            raise ValueError(f"class_path must look like 'package.module:ClassName', got {value!r}")
        _writer_class(value)
        return value

    @model_validator(mode="after")
    def _buildable(self) -> "StorageWriterSpec":
        self.build()
        return self

    def build(self) -> StorageWriter:
        """A new writer (``ValueError`` naming the class when its arguments are refused)."""
        writer_class = _writer_class(self.class_path)
        try:
            return writer_class(**self.kwargs)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"storage writer {self.class_path} refused kwargs {self.kwargs!r}: {exc}") from None


def _writer_class(class_path: str) -> type[StorageWriter]:
    module_name, _, name = class_path.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import storage writer {class_path!r}: {exc}") from None
    if not (isinstance(found, type) and issubclass(found, StorageWriter)):
        raise ValueError(f"{class_path!r} is not a StorageWriter subclass (gym_patches.checkpoint.storage)")
    return found


def install_writer(spec: StorageWriterSpec | None) -> StorageWriter:
    """At a process's startup: the writer ``spec`` names (plain files for None) becomes its default."""
    writer = FileSystemWriter() if spec is None else spec.build()
    use_process_writer(writer)
    return writer
