"""Atomic file writes through a ``StorageWriter``, and the digests taken as they are written.

A file is written to a temporary name beside it and committed over its name by the writer
(``gym_patches.checkpoint.storage``), so a crash leaves the old file or the new one, never a torn one,
and a failure raises ``RunWriteError`` naming the file. Inside ``recording_digests(root)`` each file
written under ``root`` keeps its sha256, so a checkpoint's seal (``snapshot_store``) need not read it
back. Used by the checkpoint stores and by the run's own records; a caller that passes no writer writes
plain files (``PLAIN_FILES``).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Callable, NamedTuple

from gym_patches.checkpoint.storage import FileSystemWriter, StorageWriter
from nemo_rl.utils.write_errors import naming_write

PLAIN_FILES: StorageWriter = FileSystemWriter()  # stateless: what a caller that passes no writer writes through


class Written(NamedTuple):
    """A file's digest and size as written."""

    sha256: str
    size: int


# ----- digests taken while writing ---------------------------------------------
def _stat_key(st: os.stat_result) -> tuple[int, int, int]:
    """What changes when a file is rewritten: a recorded digest is only trusted while it is unchanged."""
    return st.st_size, st.st_mtime_ns, st.st_ino


class WrittenDigests:
    """sha256 and size of the files ``write_bytes_atomic`` wrote under ``root`` while recording.

    The seal takes these instead of reading the files back; a file changed since (another size,
    mtime or inode) or written some other way is hashed at seal time as before.
    """

    def __init__(self, root: str | Path):
        self.root = Path(os.path.abspath(root))
        self._files: dict[str, tuple[Written, tuple[int, int, int]]] = {}

    def note(self, path: Path, sha256: str) -> bool:
        """Record ``path`` (just written, with digest ``sha256``) if it lies under ``root``."""
        try:
            rel = Path(os.path.abspath(path)).relative_to(self.root).as_posix()
        except ValueError:
            return False
        st = os.stat(path)
        self._files[rel] = (Written(sha256, st.st_size), _stat_key(st))
        return True

    def entry(self, rel: str, path: Path) -> Written | None:
        """The recorded entry for ``rel`` if the file on disk is still the one written, else None."""
        recorded = self._files.get(rel)
        if recorded is None or _stat_key(os.stat(path)) != recorded[1]:
            return None
        return recorded[0]

    def __len__(self) -> int:
        return len(self._files)


_recording: contextvars.ContextVar[tuple[WrittenDigests, ...]] = contextvars.ContextVar(
    "atomic_write_recording", default=())


@contextlib.contextmanager
def recording_digests(root: str | Path) -> Iterator[WrittenDigests]:
    """While open (in this thread / task), ``write_bytes_atomic`` under ``root`` keeps each file's
    digest (and ``write_stream_atomic`` each file it streams); a seal given the result (``snapshot_store``:
    ``publish_trainer_step`` / ``commit_snapshot``) reads nothing back."""
    digests = WrittenDigests(root)
    token = _recording.set(_recording.get() + (digests,))
    try:
        yield digests
    finally:
        _recording.reset(token)


# ----- the writes ----------------------------------------------------------
def _temp_beside(path: Path) -> Path:
    return path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"


def _note_digest(path: Path, sha256: Callable[[], str]) -> None:
    recorders = _recording.get()
    if recorders:
        digest = sha256()
        for digests in recorders:
            digests.note(path, digest)


def write_bytes_atomic(path: str | Path, data: bytes, writer: StorageWriter = PLAIN_FILES) -> None:
    """Write a temp file in the same directory through ``writer``, then commit it over ``path``.
    Inside ``recording_digests`` the sha256 of ``data`` is kept for the seal.

    Any failure raises ``RunWriteError`` naming ``path`` (not the temp file) and the OS error; the
    temp file is removed, so no torn file is left.
    """
    path = Path(path)
    with naming_write(path):
        writer.make_dirs(path.parent)
        tmp = _temp_beside(path)
        try:
            writer.write(tmp, data)
            writer.commit(tmp, path)
        except BaseException:
            writer.remove(tmp)
            raise
        _note_digest(path, lambda: hashlib.sha256(data).hexdigest())


class _HashingStream:
    """A write-only file that hashes what passes through it (``torch.save`` needs write and flush)."""

    def __init__(self, out: IO[bytes]):
        self._out, self.sha256 = out, hashlib.sha256()

    def write(self, data) -> int:
        self.sha256.update(data)
        return self._out.write(data)

    def flush(self) -> None:
        self._out.flush()


def write_stream_atomic(path: str | Path, fill: Callable[[Any], None], writer: StorageWriter = PLAIN_FILES) -> None:
    """``write_bytes_atomic`` for a file written in pieces: ``fill(file)`` writes it (``torch.save``), so
    no copy of the whole file is held in memory; its digest is taken as it streams."""
    path = Path(path)
    with naming_write(path):
        writer.make_dirs(path.parent)
        tmp = _temp_beside(path)
        try:
            with writer.open_write(tmp) as out:
                stream = _HashingStream(out)
                fill(stream)
            writer.commit(tmp, path)
        except BaseException:
            writer.remove(tmp)
            raise
        _note_digest(path, stream.sha256.hexdigest)


def write_json_atomic(path: str | Path, obj: Any, writer: StorageWriter = PLAIN_FILES) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode(), writer)
