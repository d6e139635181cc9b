"""The storage seam of every checkpoint file, both sides: a ``StorageWriter``, handed down.

Shaped like ``torch.distributed.checkpoint``'s writer (docs/design.md §5.4, §4.7):
a store decides *what* goes where (names, temp files, manifests); the writer
moves the bytes and owns the commit. Files are written (``write``,
``open_write``, ``put`` for a file a library wrote itself), then committed
(``commit``: renamed into place, durably); directories are made and removed
through it too. So a writer for another medium (none is shipped) needs no
change to the stores, and a test hands a store one that fails like a full
disk. There is no process-wide default: whoever builds a store passes the
writer it was given (the driver and each Gym server build theirs from the run's config,
``StorageWriterSpec``). This is the one definition; RL imports it (Gym never
imports RL). Reads are plain file reads.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import shutil
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class StorageWriter(ABC):
    """Writes a checkpoint's files and commits them. After a write or ``put`` returns, the file is
    durable under its (temporary) name; after ``commit`` returns, it or the directory is durable under
    its final name. Every failure is an ``OSError`` naming the path."""

    @abstractmethod
    def write(self, path: Path, data: bytes) -> None:
        """Create or truncate ``path`` and write ``data``."""

    @abstractmethod
    def open_write(self, path: Path) -> contextlib.AbstractContextManager[IO[bytes]]:
        """``path`` opened for writing in binary, for a file streamed in pieces (``torch.save``);
        durable once the block exits without an error."""

    @abstractmethod
    def put(self, path: Path, staged: Path) -> None:
        """The local file ``staged`` (a library wrote it: ``save_pretrained``) becomes ``path``; ``staged``
        is gone afterwards."""

    @abstractmethod
    def commit(self, src: Path, dst: Path, *, replace: bool = True) -> None:
        """Rename the file or directory ``src`` to ``dst``, durably (a directory with everything under it).
        ``replace=False``: ``FileExistsError`` if ``dst`` exists (a file created exactly once)."""

    @abstractmethod
    def make_dirs(self, path: Path) -> None:
        """``path`` and its missing parents exist (existing ones are fine)."""

    @abstractmethod
    def remove(self, path: Path) -> None:
        """A file or a whole directory goes; a missing one is fine."""

    @contextlib.contextmanager
    def staging(self, directory: Path) -> Iterator[Path]:
        """A local directory for a library that writes its files itself; on a clean exit each file in it
        is ``put`` under ``directory`` (sub-directories kept), and it is removed either way. A failure
        to make it names ``directory``; a failed put names the file it was to become."""
        scratch = Path(directory) / f".staging-{uuid.uuid4().hex[:12]}"
        try:
            scratch.mkdir(parents=True)
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, str(directory)) from exc
        try:
            yield scratch
            for dirpath, _dirs, names in os.walk(scratch):
                for name in sorted(names):
                    staged = Path(dirpath) / name
                    dest = Path(directory) / staged.relative_to(scratch)
                    try:
                        self.put(dest, staged)
                    except OSError as exc:
                        if exc.filename == str(dest):
                            raise
                        raise OSError(exc.errno, exc.strerror, str(dest)) from exc
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileSystemWriter(StorageWriter):
    """Plain files on a local (POSIX) file system: fsync each file, rename, fsync the parents."""

    def write(self, path: Path, data: bytes) -> None:
        with open(path, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())

    @contextlib.contextmanager
    def open_write(self, path: Path) -> Iterator[IO[bytes]]:
        with open(path, "wb") as out:
            yield out
            out.flush()
            os.fsync(out.fileno())

    def put(self, path: Path, staged: Path) -> None:
        with open(staged, "rb") as fh:
            os.fsync(fh.fileno())
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        os.replace(staged, path)
        _fsync_dir(Path(path).parent)

    def commit(self, src: Path, dst: Path, *, replace: bool = True) -> None:
        src, dst = Path(src), Path(dst)
        if src.is_dir():
            for dirpath, _dirs, _files in os.walk(src):  # every entry inside is durable before the rename
                _fsync_dir(Path(dirpath))
        if replace:
            os.replace(src, dst)
        else:
            os.link(src, dst)  # FileExistsError if it exists: never replaced
            os.unlink(src)
        _fsync_dir(dst.parent)
        if src.parent != dst.parent:
            _fsync_dir(src.parent)

    def make_dirs(self, path: Path) -> None:
        path = Path(path)
        missing = []
        while not path.exists():
            missing.append(path)
            path = path.parent
        for made in reversed(missing):
            with contextlib.suppress(FileExistsError):
                made.mkdir()
            _fsync_dir(made.parent)

    def remove(self, path: Path) -> None:
        path = Path(path)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, onerror=_gone_is_fine)
        else:
            path.unlink(missing_ok=True)


def _gone_is_fine(function, path, exc_info) -> None:
    """``rmtree``'s error handler: an entry already gone is what was asked for; any other error is raised."""
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]


_CLASS_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class StorageWriterSpec(BaseModel):
    """A ``StorageWriter`` class named in a config (``package.module:ClassName``) and its keyword
    arguments: how a run writes its checkpoint files through something other than plain files (a
    test's writer that fails like a full disk), in every process.

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


def build_writer(spec: StorageWriterSpec | None) -> StorageWriter:
    """The writer a process hands down to its stores: the one ``spec`` names, or plain files for None."""
    return FileSystemWriter() if spec is None else spec.build()
