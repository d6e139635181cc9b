"""One error type for "a file this run writes could not be written" (disk full, I/O error, read-only).

Every writer of the run (trainer checkpoints, run records, the snapshot store)
raises ``RunWriteError`` naming the file it was writing and the OS error, so
``examples/run_grpo.py`` ends the run with one ``error:`` line and exit 1
instead of a traceback. It is an ``OSError``, so code that already treats an
``OSError`` as a failed write (a snapshot attempt's ``io_error``) keeps doing so.
Libraries that report an OS error in their own exception type (safetensors'
``SafetensorError: ... (os error 28)``) are turned into one here, at the write
that failed, because only there is the file known.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Iterator

# How Rust's std::io::Error (safetensors, tokenizers) prints an errno: "... (os error 28)".
_OS_ERROR_IN_TEXT = re.compile(r"\(os error (\d+)\)")


class RunWriteError(OSError):
    """A file the run writes could not be written; ``filename`` is that file, ``errno`` the OS error if known.

    Built like an ``OSError`` (``RunWriteError(errno, strerror, filename)``) so it pickles and
    compares like one; only the message differs: ``cannot write <file>: [Errno N] <strerror>``.
    """

    def __str__(self) -> str:
        code = f"[Errno {self.errno}] " if self.errno is not None else ""
        return f"cannot write {self.filename}: {code}{self.strerror}"


def errno_of(exc: BaseException) -> int | None:
    """The OS error number an exception carries: ``OSError.errno``, or ``(os error N)`` in its text."""
    if isinstance(exc, OSError):
        return exc.errno
    match = _OS_ERROR_IN_TEXT.search(str(exc))
    return int(match[1]) if match else None


def as_write_error(exc: BaseException, path: str | os.PathLike[str] | None) -> RunWriteError | None:
    """``exc`` as a ``RunWriteError`` naming ``path`` (or, without one, the file the OSError names);
    None for an error that is not about the OS (a bug must keep its traceback)."""
    if isinstance(exc, RunWriteError):
        return exc
    if isinstance(exc, OSError):
        where = path if path is not None else exc.filename
        return RunWriteError(exc.errno, exc.strerror or str(exc), str(where) if where is not None else "<unknown file>")
    code = errno_of(exc)
    if code is None:
        return None
    return RunWriteError(code, os.strerror(code), str(path) if path is not None else "<unknown file>")


@contextlib.contextmanager
def naming_write(path: str | os.PathLike[str] | None) -> Iterator[None]:
    """Around one file write: an OS-level failure leaves as ``RunWriteError`` naming ``path``.

    An inner ``RunWriteError`` (a helper that already named its file) passes through unchanged.
    """
    try:
        yield
    except Exception as exc:
        converted = as_write_error(exc, path)
        if converted is None or converted is exc:
            raise
        raise converted from exc


def newest_file(directory: str | os.PathLike[str], since: float) -> Path | None:
    """The file in ``directory`` modified last at or after ``since`` (time.time()), if any.

    For writers that fail without naming the file (an ``OSError`` raised by
    ``write()`` carries no filename): the one they were writing is the newest.
    """
    best: tuple[float, Path] | None = None
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            with contextlib.suppress(OSError):
                if entry.is_file(follow_symlinks=False):
                    mtime = entry.stat(follow_symlinks=False).st_mtime
                    # File times come from the kernel's coarse clock, a few ms behind time.time().
                    if mtime >= since - 0.05 and (best is None or mtime >= best[0]):
                        best = (mtime, Path(entry.path))
    return best[1] if best else None
