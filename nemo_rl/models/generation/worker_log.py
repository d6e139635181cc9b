"""A generation worker's own log file: everything its process writes (Python's output, a fatal error's
traceback, native libraries' messages) goes there instead of Ray's worker log, so the run's log dir names
it when the worker is lost (docs/design.md §5.12)."""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path


def redirect_output(path: str | os.PathLike[str]) -> None:
    """Send this process's stdout and stderr (file descriptors 1 and 2) to ``path``, appended."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)
    faulthandler.enable(file=sys.stderr, all_threads=True)


def log_tail(path: str | os.PathLike[str] | None, max_chars: int = 2000) -> str:
    """The last lines of a worker's log ('' when there is none)."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_chars))
            return f.read().decode(errors="replace")
    except OSError:
        return ""
