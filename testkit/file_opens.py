"""How many times each file of a directory is opened, by any process, counted by the kernel (Linux inotify).

A restore's reads of a checkpoint's weights are counted this way by the tests and the benchmark
(``tests/functional/test_restore_data_path.py``, ``examples/bench/restore_io.py``): every reader of a
whole file opens it once (a hash reads it; safetensors and ``torch.load`` map or read it), whatever
process or library reads it and whichever commit of the product runs. Opens of the directory
itself (listing it) are not counted.

    with FileOpens([step_dir]) as opens:
        ...
    opens.counts()  # {"step_1/model.safetensors": 2, ...}
"""

from __future__ import annotations

import ctypes
import os
import struct
from pathlib import Path
from typing import Iterable

IN_OPEN = 0x20
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then the name, NUL-padded)


def available() -> str | None:
    """None when inotify can be used here, else why not."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, AttributeError) as exc:
        return f"no inotify ({exc})"
    if fd < 0:
        return f"inotify_init1 failed: {os.strerror(ctypes.get_errno())}"
    os.close(fd)
    return None


class FileOpens:
    """Counts opens of the files directly inside each of ``directories`` while open (a context manager).

    Names are ``<directory name>/<file name>``. ``counts()`` reads the events so far; call it before the
    block ends or after (the count is kept)."""

    def __init__(self, directories: Iterable[str | Path]):
        self.directories = [Path(d) for d in directories]
        self._libc = ctypes.CDLL("libc.so.6", use_errno=True)
        self._fd = -1
        self._names: dict[int, str] = {}
        self._counts: dict[str, int] = {}

    def __enter__(self) -> "FileOpens":
        self._fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        for d in self.directories:
            wd = self._libc.inotify_add_watch(self._fd, os.fsencode(d), IN_OPEN)
            if wd < 0:
                err = ctypes.get_errno()
                os.close(self._fd)
                raise OSError(err, os.strerror(err), str(d))
            self._names[wd] = d.name
        return self

    def __exit__(self, *exc) -> None:
        self._drain()
        os.close(self._fd)
        self._fd = -1

    def _drain(self) -> None:
        if self._fd < 0:
            return
        while True:
            try:
                buf = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                return
            at = 0
            while at < len(buf):
                wd, mask, _cookie, length = _EVENT.unpack_from(buf, at)
                name = buf[at + _EVENT.size: at + _EVENT.size + length].rstrip(b"\0").decode(errors="replace")
                at += _EVENT.size + length
                if mask & IN_OPEN and name and wd in self._names:
                    key = f"{self._names[wd]}/{name}"
                    self._counts[key] = self._counts.get(key, 0) + 1

    def counts(self) -> dict[str, int]:
        self._drain()
        return dict(self._counts)
