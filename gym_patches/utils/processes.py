"""Child processes that never outlive their parent."""

from __future__ import annotations

import ctypes
import os
import select
import signal
import socket
import sys
import time
from typing import Callable

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """preexec_fn: ask Linux to SIGKILL this child when its parent dies."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def process_state(pid: int) -> tuple[str, float] | None:
    """``(state letter, CPU seconds used so far)`` of a live process from ``/proc/<pid>/stat``
    (``T``: stopped), or None if it is gone or unreadable. Two readings tell a busy process from one
    that is stuck waiting: only the busy one's CPU seconds grow."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return fields[0], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def process_tree(pid: int) -> list[int]:
    """``pid`` and every live descendant of it on this host (read from ``/proc``: each process's parent)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    parents[int(entry)] = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    if pid not in parents:
        return []
    tree, frontier = [pid], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        tree += frontier
    return tree


def wait_gone(pids: list[int], deadline: float, stop: Callable[[], bool] = lambda: False) -> list[int]:
    """Block until every process of ``pids`` has exited (each told by its pidfd), ``time.monotonic()``
    passes ``deadline`` or ``stop()`` says so (looked at every 0.1 s); returns those still running."""
    fds: dict[int, int] = {}
    try:
        for pid in pids:
            try:
                fds[os.pidfd_open(pid)] = pid
            except ProcessLookupError:
                continue
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        running = set(fds)
        while running and not stop():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for fd, _ in poller.poll(int(min(left, 0.1) * 1000)):
                running.discard(fd)
                poller.unregister(fd)
        return sorted(fds[fd] for fd in running)
    finally:
        for fd in fds:
            os.close(fd)


def signals_blocked() -> bool:
    """Whether SIGTERM is blocked here, and so in every child started from here: a launcher that
    stops such children with SIGTERM would wait in vain (docs/design.md §5.11)."""
    return signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bound and released): another process may take it before
    it is bound again. A server this process starts itself should get a ``listening_socket``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Nothing listens on ``host:port``: a bind as a server would do it (``SO_REUSEADDR``) succeeds."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


class PortHold:
    """A loopback port kept for a server that another process (a Ray actor) will start: bound, not
    listening, with ``SO_REUSEPORT``. That server binds it with ``reuse_port`` while any other bind
    fails, so the port cannot be taken between choosing it and serving on it; ``release`` once it serves
    (idempotent). A bound socket that does not listen gets no connection."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._sock: socket.socket | None = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        self._sock.bind((host, 0))
        self.port: int = self._sock.getsockname()[1]

    @property
    def held(self) -> bool:
        return self._sock is not None

    def release(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


def listening_socket(host: str = "127.0.0.1", backlog: int = 4096) -> socket.socket:
    """A socket bound to a free port and listening: hand its descriptor to the child that serves it,
    so the port is never free between choosing it and serving on it."""
    return socket.create_server((host, 0), backlog=backlog)


def processes_with_env(name: str, value: str) -> list[int]:
    """PIDs (other than this one) whose environment has ``name=value``: every process a run started."""
    import os
    from pathlib import Path

    needle = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def wait_until_gone(name: str, value: str, timeout_s: float = 30.0) -> list[int]:
    """Wait until no process carries ``name=value``; return those still left at the timeout."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        left = processes_with_env(name, value)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)
