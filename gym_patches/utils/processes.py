"""Child processes that never outlive their parent."""

from __future__ import annotations

import ctypes
import signal
import socket
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """preexec_fn: ask Linux to SIGKILL this child when its parent dies."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bound and released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
