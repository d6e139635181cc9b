"""Run a GRPO run as a real process, kill it on a condition, reap it, read its records.

One harness for everything that starts GRPO runs from the outside: the
functional tests (``tests/functional/rl_run.py``), the crash matrix
(``examples/crash_matrix.py``) and the recovery benchmark
(``examples/bench/``). A run is ``python -m testkit.run_grpo args`` with the
repository as its working directory: the product's ``run_grpo`` main with the
test hooks (crash points, write faults) its environment asks for.

- A run is started in its own session (its own process group), with a
  *marker* in its environment (``NEMO_RL_TEST_RUN_ID=<hex>``). Ray workers, the
  Gym actors and every Gym server inherit the environment, so the marker finds
  every process of the run through ``/proc`` (``gym_patches.utils.processes``)
  even after they have left the group.
- ``run_once`` runs it until it exits, until ``kill_when(elapsed_s)`` holds
  (then SIGKILL of the group, or of the driver alone) or until a timeout, then
  waits until no marked process is left and SIGKILLs (by pid) any that outlive
  the wait, reporting them.
- ``RunDirs`` and ``read_jsonl`` read what a run wrote: ``metrics.jsonl``,
  ``snapshots.jsonl`` (a line torn by a SIGKILL is skipped) and ``restore.json``;
  ``JsonlFollower`` reads a growing JSONL file while the run writes it.
- ``scripted_overrides`` are the config overrides of the scripted fake's reply
  delay (``policy.scripted_backend``); ``run_env`` sets the test-only crash
  point and write fault and never lets the caller's own leak into a run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterable

from gym_patches.utils.processes import processes_with_env, wait_until_gone
from nemo_rl.parity.launch import RunPlace
from nemo_rl.utils.jsonl_rows import read_rows
from testkit.crash_points import CRASH_ENV

REPO = Path(__file__).resolve().parents[1]
RUN_GRPO_MODULE = "testkit.run_grpo"  # the test entry: the product's main with the test hooks
MARKER_ENV = "NEMO_RL_TEST_RUN_ID"
REAP_TIMEOUT_S = 30.0


# ----------------------------------------------------------------------------- records
read_jsonl = read_rows  # every complete row; one reader for the product and its tests


@dataclass
class RunDirs(RunPlace):
    """Where a test's run writes (``RunPlace``: ``<root>/logs`` and ``<root>/ckpt``), and what it wrote there."""

    def overrides(self) -> list[str]:
        return [f"logger.log_dir={self.logs}", f"checkpointing.checkpoint_dir={self.ckpt}", "logger.progress_bar=false"]

    def records(self, name: str) -> list[dict[str, Any]]:
        """``metrics.jsonl``, ``snapshots.jsonl``, ...: every complete line."""
        return read_jsonl(self.logs / name)

    def restore_json(self) -> dict[str, Any]:
        return json.loads((self.logs / "restore.json").read_text())

    def restore_record(self) -> dict[str, Any] | None:
        path = self.logs / "restore.json"
        return json.loads(path.read_text()) if path.exists() else None

    def restore_mtime_ns(self) -> int | None:
        path = self.logs / "restore.json"
        return path.stat().st_mtime_ns if path.exists() else None


class JsonlFollower:
    """The new complete lines of a JSONL file a run is writing, each with the wall time it was first seen."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.offset = 0
        self.items: list[tuple[float, dict[str, Any]]] = []

    def poll(self) -> list[tuple[float, dict[str, Any]]]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        now = time.time()
        new = []
        for line in data[:end].splitlines():
            if line.strip():
                try:
                    new.append((now, json.loads(line)))
                except ValueError:
                    continue
        self.offset += end
        self.items += new
        return new

    def records(self) -> list[dict[str, Any]]:
        return [r for _, r in self.items]


# ----------------------------------------------------------------------------- environment
def new_marker() -> str:
    return uuid.uuid4().hex


def scripted_overrides(delay_s: float = 0.0, jitter_s: float = 0.0) -> list[str]:
    """Config overrides for the scripted fake's replies (``policy.model_name=scripted-test-backend``):
    each waits ``delay_s`` plus up to ``jitter_s``; zero values are left at their default."""
    return [f"policy.scripted_backend.{key}={value}"
            for key, value in (("delay_s", delay_s), ("jitter_s", jitter_s)) if value]


def run_env(
    *,
    marker: str | None = None,
    crash: str | None = None,
    pythonpath: Iterable[str | Path] = (),
    extra: dict[str, str] | None = None,
    base: dict[str, str] | None = None,
) -> dict[str, str]:
    """The environment of a run: this process's, plus the marker, the test-only crash point
    (removed unless given here or in ``extra``), directories put first on ``PYTHONPATH`` (e.g. a
    ``sitecustomize`` that instruments the run) and ``extra``. (A write fault is config:
    ``testkit.write_faults.write_fault_overrides``.)
    """
    env = dict(os.environ if base is None else base)
    env.setdefault("RAY_AUTH_MODE", "disabled")
    if marker is not None:
        env[MARKER_ENV] = marker
    env.pop(CRASH_ENV, None)
    if crash:
        env[CRASH_ENV] = crash
    env.update(extra or {})
    paths = [str(p) for p in pythonpath]
    if paths:
        env["PYTHONPATH"] = os.pathsep.join([*paths, str(REPO), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    return env


def grpo_command(args: Iterable[str]) -> list[str]:
    """``python -m testkit.run_grpo args`` (run with the repository as the working directory)."""
    return [sys.executable, "-m", RUN_GRPO_MODULE, *args]


# ----------------------------------------------------------------------------- processes
def processes_with_marker(marker: str) -> list[int]:
    """PIDs whose environment carries ``NEMO_RL_TEST_RUN_ID=<marker>`` (every process a run started)."""
    return processes_with_env(MARKER_ENV, marker)


def gym_server_pid(marker: str, name: str) -> int | None:
    """The pid of the run's Gym server ``name`` (its process carries the run's marker), or None."""
    for pid in processes_with_marker(marker):
        try:
            env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
            cmd = (Path("/proc") / str(pid) / "cmdline").read_bytes()
        except OSError:
            continue
        if f"NEMO_GYM_CONFIG_PATH={name}".encode() in env and b"gym_patches.server_main" in cmd:
            return pid
    return None


def replica_server_pids(log_dir: str | Path, replica: str) -> dict[str, int]:
    """The Gym server processes of ``replica`` (e.g. ``nemo_gym/replica-1``) of the run logging under
    ``log_dir``, by server name: each one's stdout is its log there, so only that run's match (after a
    replica is started again, its new processes)."""
    logs = (Path(log_dir) / "gym-instances" / replica).resolve()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if Path(os.readlink(entry / "fd" / "1")).parent != logs:
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in environ:
            if item.startswith(b"NEMO_GYM_CONFIG_PATH="):
                found[item.split(b"=", 1)[1].decode()] = int(entry.name)
    return found


def generation_worker_pid(log_dir: str | Path) -> int | None:
    """The generation worker process of the run logging under ``log_dir`` (its stdout is its own log,
    ``generation/worker-<n>.log`` there): the newest worker's, or None when none is up."""
    logs = (Path(log_dir) / "generation").resolve()
    newest: tuple[int, int] | None = None  # (n, pid)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            target = Path(os.readlink(entry / "fd" / "1"))
        except OSError:
            continue
        if target.parent == logs and target.name.startswith("worker-") and target.suffix == ".log":
            n = int(target.stem.split("-", 1)[1])
            if newest is None or n > newest[0]:
                newest = (n, int(entry.name))
    return None if newest is None else newest[1]


def parent_pid(pid: int) -> int:
    """The parent of ``pid`` (a Gym server's: its replica's ``NemoGym`` actor process)."""
    return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])


def wait_for_no_processes(marker: str, timeout_s: float = REAP_TIMEOUT_S) -> list[int]:
    """Wait until no process of the run is left; the PIDs still there at the timeout."""
    return wait_until_gone(MARKER_ENV, marker, timeout_s)


def reap(marker: str, timeout_s: float = REAP_TIMEOUT_S) -> list[int]:
    """Wait until no process of the run is left; SIGKILL (by pid) any that outlive the wait and return them."""
    left = wait_for_no_processes(marker, timeout_s)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


def start_run(args: Iterable[str], *, env: dict[str, str], stdout: IO | int | None = subprocess.DEVNULL,
              stderr: IO | int | None = subprocess.DEVNULL, cwd: str | Path = REPO) -> subprocess.Popen:
    """``grpo_command(args)`` in its own session (so one ``killpg`` reaches its whole group), in ``cwd``
    (this repository; a benchmark may run another checkout of the product)."""
    return subprocess.Popen(grpo_command(args), cwd=cwd, env=env, stdout=stdout, stderr=stderr,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def kill_group(proc: subprocess.Popen, wait_s: float = 60.0) -> None:
    """SIGKILL the run's process group (started by ``start_run``) and wait for the driver."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=wait_s)


def kill_driver(proc: subprocess.Popen, wait_s: float = 60.0) -> None:
    """SIGKILL the driver process only (as an OOM kill would); its children must die with it."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=wait_s)


def run_grpo(args: list[str], *, env: dict[str, str], timeout_s: float = 240) -> subprocess.CompletedProcess:
    """Run to the end and capture its output (``subprocess.TimeoutExpired`` after ``timeout_s``)."""
    return subprocess.run(grpo_command(args), env=env, capture_output=True, text=True, timeout=timeout_s, cwd=REPO)


@dataclass
class RunOutcome:
    """How one run of ``run_once`` ended."""

    returncode: int | None
    killed_by: str | None  # "group" / "driver" (kill_when held), "timeout", or None (it exited by itself)
    wall_s: float  # start to end of the driver
    marker: str
    stdout_path: Path | None = None
    stderr_path: Path | None = None
    leftover: list[int] = field(default_factory=list)  # processes still alive after the reap wait (then killed)
    cleanup_s: float = 0.0  # from the driver's end until no marked process was left
    killed_at: float | None = None  # time.time() of the kill

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace") if self.stdout_path and self.stdout_path.exists() else ""

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace") if self.stderr_path and self.stderr_path.exists() else ""

    def tail(self, lines: int = 12) -> str:
        text = self.stderr() if self.stderr_path != self.stdout_path else ""
        return "\n".join((self.stdout() + text).strip().splitlines()[-lines:])


def run_once(
    args: list[str],
    *,
    env: dict[str, str],
    stdout_path: str | Path | None = None,
    stderr_path: str | Path | None = None,
    kill_when: Callable[[float], bool] | None = None,
    kill_driver_only: bool = False,
    stop: Callable[[subprocess.Popen], str] | None = None,
    timeout_s: float = 240.0,
    poll_s: float = 0.02,
    reap_after: bool = True,
    reap_timeout_s: float = REAP_TIMEOUT_S,
    cwd: str | Path = REPO,
) -> RunOutcome:
    """Run ``grpo_command(args)`` once.

    ``kill_when(elapsed_s)`` is polled every ``poll_s`` while the run lives; once
    it holds, the group (or with ``kill_driver_only`` the driver alone) is
    SIGKILLed; a ``stop(proc)`` given acts instead (e.g. a SIGTERM, then a wait for the exit) and
    returns what ``killed_by`` says. After ``timeout_s`` the group is SIGKILLed (``killed_by="timeout"``).
    Output goes to ``stdout_path``/``stderr_path`` (the same path merges them;
    none: discarded). ``env`` gets a fresh marker if it has none; with
    ``reap_after`` the call returns only once no process of the run is left
    (stragglers are killed by pid and listed in ``leftover``). ``cwd``: the checkout that runs.
    """
    env = dict(env)
    marker = env.setdefault(MARKER_ENV, new_marker())
    out_p = Path(stdout_path) if stdout_path else None
    err_p = Path(stderr_path) if stderr_path else None
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(open(out_p, "wb")) if out_p else subprocess.DEVNULL
        if err_p is not None and err_p == out_p:
            err: Any = subprocess.STDOUT
        else:
            err = stack.enter_context(open(err_p, "wb")) if err_p else subprocess.DEVNULL
        started = time.monotonic()
        proc = start_run(args, env=env, stdout=out, stderr=err, cwd=cwd)
        killed_by = killed_at = None
        try:
            while proc.poll() is None:
                elapsed = time.monotonic() - started
                if elapsed > timeout_s:
                    killed_by, killed_at = "timeout", time.time()
                    kill_group(proc)
                    break
                if kill_when is not None and kill_when(elapsed):
                    killed_at = time.time()
                    if stop is not None:
                        killed_by = stop(proc)
                    elif kill_driver_only:
                        killed_by = "driver"
                        kill_driver(proc)
                    else:
                        killed_by = "group"
                        kill_group(proc)
                    break
                time.sleep(poll_s)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                kill_group(proc)
    ended = time.monotonic()
    outcome = RunOutcome(proc.returncode, killed_by, ended - started, marker, out_p, err_p, killed_at=killed_at)
    if reap_after:
        outcome.leftover = reap(marker, reap_timeout_s)
        outcome.cleanup_s = time.monotonic() - ended
    return outcome


# ----------------------------------------------------------------------------- kill conditions
def after_committed_snapshots(dirs: RunDirs, nth: int, extra_s: float = 0.0) -> Callable[[float], bool]:
    """Holds ``extra_s`` after the ``nth`` snapshot committed from now on (counted in ``snapshots.jsonl``)."""
    before = sum(1 for s in dirs.records("snapshots.jsonl") if s.get("committed"))
    seen_at: list[float] = []

    def check(elapsed: float) -> bool:
        if not seen_at:
            if sum(1 for s in dirs.records("snapshots.jsonl") if s.get("committed")) - before >= nth:
                seen_at.append(elapsed)
            return False
        return elapsed >= seen_at[0] + extra_s
    return check


def after_committed_in_step(dirs: RunDirs, step: int, extra_s: float = 0.0) -> Callable[[float], bool]:
    """Holds ``extra_s`` after a snapshot of trainer step >= ``step`` that saved rollouts is committed."""
    seen_at: list[float] = []

    def check(elapsed: float) -> bool:
        if not seen_at:
            if any(s.get("committed") and s.get("step", 0) >= step and s.get("saved", 0) > 0
                   for s in dirs.records("snapshots.jsonl")):
                seen_at.append(elapsed)
            return False
        return elapsed >= seen_at[0] + extra_s
    return check
