"""The processes of a run, found from outside by what they write: where the parity harness sends its signals.

Every process of a run carries a marker in its environment (the harness sets it, and Ray workers, Gym
actors and Gym servers inherit it), so the whole run is found through ``/proc`` even after its processes
left the driver's process group. A run's Gym servers write their stdout to
``<logger.log_dir>/gym-instances/<shard>/replica-<i>/<server>.log`` and its generation workers to
``<logger.log_dir>/generation/worker-<n>.log``: a process whose stdout is one of those files is that
server (its name is also in its ``NEMO_GYM_CONFIG_PATH``) or that worker. A server's parent is its
replica's Gym actor. Nothing here knows how the run recovers.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

from gym_patches.utils.processes import processes_with_env, wait_until_gone

MARKER_ENV = "NEMO_RL_PARITY_RUN"
GYM_LOGS = "gym-instances"
HEAD_SERVER = "head_server"
_CONFIG_NAME = b"NEMO_GYM_CONFIG_PATH="


def _stdout_of(pid_dir: Path) -> Path | None:
    try:
        return Path(os.readlink(pid_dir / "fd" / "1"))
    except OSError:
        return None


def _pids() -> list[Path]:
    return [p for p in Path("/proc").iterdir() if p.name.isdigit()]


def replicas(log_dir: str | os.PathLike) -> list[str]:
    """The Gym replicas a run has logged (``<shard>/replica-<i>``), sorted."""
    root = Path(log_dir) / GYM_LOGS
    return sorted(f"{s.name}/{r.name}" for s in root.iterdir() if s.is_dir()
                  for r in s.iterdir() if r.is_dir() and r.name.startswith("replica-")) if root.is_dir() else []


def replica_servers(log_dir: str | os.PathLike, replica: str) -> dict[str, int]:
    """The live server processes of ``replica``, by server name (after a restart: the new ones)."""
    logs = (Path(log_dir) / GYM_LOGS / replica).resolve()
    found = {}
    for entry in _pids():
        out = _stdout_of(entry)
        if out is None or out.parent != logs:
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in environ:
            if item.startswith(_CONFIG_NAME):
                found[item[len(_CONFIG_NAME):].decode()] = int(entry.name)
    return found


def parent_pid(pid: int) -> int | None:
    """The parent of ``pid`` (a Gym server's: its replica's actor), or None if it is gone."""
    try:
        return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def generation_worker(log_dir: str | os.PathLike) -> int | None:
    """The newest live generation worker of the run logging under ``log_dir``, or None."""
    logs = (Path(log_dir) / "generation").resolve()
    newest: tuple[int, int] | None = None
    for entry in _pids():
        out = _stdout_of(entry)
        if out is None or out.parent != logs or not out.name.startswith("worker-") or out.suffix != ".log":
            continue
        try:
            n = int(out.stem.split("-", 1)[1])
        except ValueError:
            continue
        if newest is None or n > newest[0]:
            newest = (n, int(entry.name))
    return None if newest is None else newest[1]


def send(pids: dict[str, int], sig: int) -> dict[str, int]:
    """Send ``sig`` to each pid; returns those it reached."""
    hit = {}
    for name, pid in pids.items():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
            hit[name] = pid
    return hit


def run_processes(marker: str) -> list[int]:
    return processes_with_env(MARKER_ENV, marker)


def reap(marker: str, timeout_s: float = 30.0) -> list[int]:
    """Wait until no process of the run is left (SIGCONT first: a stopped one would never go), then
    SIGKILL those still there; returns them."""
    for pid in run_processes(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    left = wait_until_gone(MARKER_ENV, marker, timeout_s)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left
