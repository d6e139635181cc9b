"""One writer per run directory: an OS lock on ``logger.log_dir`` and ``checkpointing.checkpoint_dir``.

Two launches of the same command on the same directories would both train,
append the same steps to ``metrics.jsonl`` and publish different snapshots
under one name, deleting each other's ``.tmp-`` files. The first launch takes
an exclusive ``flock`` on ``<dir>/.nemo_rl.lock`` in each distinct directory
and writes who it is into the file; a second one fails at once, before
anything in the directories is touched, naming the holder. The kernel drops a
lock when its holder dies (also by SIGKILL), so a crash never leaves a run
directory locked; the fd is closed in every child (close-on-exec, and at fork),
so a Gym server or Ray worker that outlives the driver does not keep it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

from pydantic import BaseModel, ConfigDict, ValidationError

from nemo_rl.utils.write_errors import naming_write

LOCK_FILE = ".nemo_rl.lock"
_HOLDER_WAIT_S = 1.0  # how long a refused launch waits for the holder to write its record

# Lock fds this process holds; a forked child closes its copies (closing, unlike LOCK_UN, leaves the lock to us).
_HELD_FDS: set[int] = set()


def _close_held_in_child() -> None:
    for fd in _HELD_FDS:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD_FDS.clear()


os.register_at_fork(after_in_child=_close_held_in_child)


class LockHolder(BaseModel):
    """Who holds a run directory: what the refused launch prints."""

    model_config = ConfigDict(extra="ignore")

    pid: int
    host: str
    started_at: str  # ISO-8601, UTC

    @classmethod
    def me(cls) -> "LockHolder":
        return cls(pid=os.getpid(), host=socket.gethostname(),
                   started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}, started {self.started_at}"


class RunDirLockedError(RuntimeError):
    """Another live process holds the run directory; the message names it and the holder."""

    def __init__(self, directory: Path, keys: list[str], holder: LockHolder | None):
        self.directory, self.keys, self.holder = directory, keys, holder
        who = holder.describe() if holder is not None else "its pid not recorded yet"
        named = f" ({' and '.join(keys)})" if keys else ""
        super().__init__(f"{directory}{named} is in use by another run: {who}. Wait for it to end, or use "
                         f"another {keys[0] if keys else 'directory'}")


class DirLock:
    """The held lock of one directory; ``release`` ends it (and removes the lock file)."""

    def __init__(self, directory: Path, fd: int):
        self.directory, self.fd = directory, fd
        self.path = directory / LOCK_FILE

    @classmethod
    def acquire(cls, directory: str | Path, keys: list[str] | None = None) -> "DirLock":
        """Lock ``directory`` (created if missing) or raise ``RunDirLockedError`` at once (never waits)."""
        directory = Path(directory)
        with naming_write(directory):  # an unwritable directory is one error line naming it
            directory.mkdir(parents=True, exist_ok=True)
        directory = directory.resolve()
        path = directory / LOCK_FILE
        while True:
            with naming_write(path):
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    holder = _read_holder(fd)
                finally:
                    os.close(fd)
                raise RunDirLockedError(directory, keys or [], holder) from None
            except BaseException:
                os.close(fd)
                raise
            if _same_file(fd, path):
                break
            os.close(fd)  # the holder removed this file as it released: lock the one at the path now
        _HELD_FDS.add(fd)
        data = LockHolder.me().model_dump_json().encode() + b"\n"
        os.ftruncate(fd, 0)  # a SIGKILLed holder's record is still in the file
        os.pwrite(fd, data, 0)
        return cls(directory, fd)

    def release(self) -> None:
        """Remove the file while still holding it (no one can lock an unlinked file in its place), then close."""
        if self.fd < 0:
            return
        with contextlib.suppress(OSError):
            if _same_file(self.fd, self.path):
                self.path.unlink()
        _HELD_FDS.discard(self.fd)
        os.close(self.fd)
        self.fd = -1


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _read_holder(fd: int) -> LockHolder | None:
    """The holder's record; it may be a moment late (taken, not yet written) or a dead holder's (not yet
    overwritten), so wait briefly for one that names a live process."""
    deadline = time.monotonic() + _HOLDER_WAIT_S
    holder = None
    while True:
        try:
            holder = LockHolder.model_validate_json(os.pread(fd, 4096, 0))
        except (OSError, ValidationError, ValueError):
            holder = None
        if holder is not None and (holder.host != socket.gethostname() or _alive(holder.pid)):
            return holder
        if time.monotonic() > deadline:
            return holder
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_dirs(log_dir: str | Path, checkpoint_dir: str | Path | None) -> dict[Path, list[str]]:
    """Each distinct resolved directory a run writes, with the config keys that name it."""
    named = [(Path(log_dir), "logger.log_dir")]
    if checkpoint_dir is not None:
        named.append((Path(checkpoint_dir), "checkpointing.checkpoint_dir"))
    out: dict[Path, list[str]] = {}
    for path, key in named:
        out.setdefault(path.resolve(), []).append(key)
    return dict(sorted(out.items()))  # one order for every launch


@contextlib.contextmanager
def hold_run_dirs(log_dir: str | Path, checkpoint_dir: str | Path | None) -> Iterator[list[DirLock]]:
    """Hold every run directory for the block (``checkpoint_dir`` None: checkpointing is off)."""
    held: list[DirLock] = []
    try:
        for directory, keys in run_dirs(log_dir, checkpoint_dir).items():
            held.append(DirLock.acquire(directory, keys))
        yield held
    finally:
        for lock in reversed(held):
            lock.release()
