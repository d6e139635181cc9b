"""One writer per run directory (``nemo_rl.utils.run_lock``), with real processes: a second holder is
refused naming the first, a race has one winner, a SIGKILL frees the lock, a child never keeps it."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from nemo_rl.utils.run_lock import LOCK_FILE, DirLock, RunDirLockedError, hold_run_dirs

REPO = Path(__file__).resolve().parents[2]

# Holds hold_run_dirs(argv[1], argv[2] or None) until stdin closes; prints "held" (or the error) first.
HOLDER = textwrap.dedent("""
    import sys
    from nemo_rl.utils.run_lock import RunDirLockedError, hold_run_dirs
    try:
        with hold_run_dirs(sys.argv[1], sys.argv[2] or None):
            print("held", flush=True)
            sys.stdin.read()
    except RunDirLockedError as exc:
        print(f"error: {exc}", flush=True)
""")

# Holds a lock, then starts a child by subprocess (fds not closed) and one by fork; each child's pid is
# printed once it runs (the forked one prints its own: its fork handlers have run by then).
PARENT_WITH_CHILDREN = textwrap.dedent("""
    import os, subprocess, sys, time
    from nemo_rl.utils.run_lock import DirLock
    DirLock.acquire(sys.argv[1])
    spawned = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], close_fds=False)
    print(spawned.pid, flush=True)
    if os.fork() == 0:
        print(os.getpid(), flush=True)
        time.sleep(60)
        os._exit(0)
    time.sleep(60)
""")


def _start_holder(log_dir: Path, ckpt_dir: Path | None = None) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(log_dir), str(ckpt_dir or "")], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    line = proc.stdout.readline().strip()
    assert line == "held", line
    return proc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.stdin.close()
        proc.wait(timeout=30)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_a_second_acquire_in_another_process_fails_naming_the_holder(tmp_path):
    holder = _start_holder(tmp_path)
    try:
        with pytest.raises(RunDirLockedError) as info:
            DirLock.acquire(tmp_path, ["logger.log_dir"])
        record = info.value.holder
        assert record is not None and record.pid == holder.pid and record.host == socket.gethostname()
        started = datetime.fromisoformat(record.started_at)
        assert started.utcoffset() == timezone.utc.utcoffset(None)
        assert abs((datetime.now(timezone.utc) - started).total_seconds()) < 60
        assert str(info.value) == (
            f"{tmp_path.resolve()} (logger.log_dir) is in use by another run: pid {holder.pid} on host "
            f"{socket.gethostname()}, started {record.started_at}. Wait for it to end, or use another logger.log_dir")
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == holder.pid  # who holds it, on disk
    finally:
        _stop(holder)
    assert holder.returncode == 0
    assert not (tmp_path / LOCK_FILE).exists()  # a clean release leaves nothing behind
    DirLock.acquire(tmp_path).release()


def _race(directory: str, barrier, results, release) -> None:
    barrier.wait()
    try:
        lock = DirLock.acquire(directory)
    except RunDirLockedError as exc:
        results.put(("lost", os.getpid(), exc.holder.pid if exc.holder else None))
        return
    results.put(("won", os.getpid(), os.getpid()))
    release.wait(30)
    lock.release()


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_many_processes_racing_for_one_directory_exactly_one_wins(tmp_path, start_method):
    ctx = multiprocessing.get_context(start_method)
    for _ in range(3):  # the same directory each round: the last winner's lock file was removed as it released
        barrier, results, release = ctx.Barrier(6), ctx.Queue(), ctx.Event()
        procs = [ctx.Process(target=_race, args=(str(tmp_path), barrier, results, release)) for _ in range(6)]
        for p in procs:
            p.start()
        outcomes = [results.get(timeout=60) for _ in procs]
        release.set()
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
        winners = [pid for kind, pid, _ in outcomes if kind == "won"]
        assert len(winners) == 1, outcomes
        assert all(holder == winners[0] for kind, _, holder in outcomes if kind == "lost"), outcomes


def _churn(directory: str, rounds: int, violations) -> None:
    """Take and release the lock again and again; while held, no one else may be inside."""
    inside = Path(directory) / "inside"
    for _ in range(rounds):
        try:
            lock = DirLock.acquire(directory)
        except RunDirLockedError:
            continue
        try:
            fd = os.open(inside, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            with violations.get_lock():
                violations.value += 1
            lock.release()
            continue
        os.close(fd)
        time.sleep(0.001)
        inside.unlink()
        lock.release()


def test_acquire_and_release_in_a_loop_never_lets_two_in(tmp_path):
    """Releasing removes the lock file; one who opened the old file just before must not think it holds it."""
    ctx = multiprocessing.get_context("spawn")
    violations = ctx.Value("i", 0)
    procs = [ctx.Process(target=_churn, args=(str(tmp_path), 300, violations)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert violations.value == 0


def test_the_lock_is_released_when_the_holder_is_sigkilled(tmp_path):
    holder = _start_holder(tmp_path)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(timeout=30)
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == holder.pid  # the dead holder's record stays
    lock = DirLock.acquire(tmp_path)  # ... but not its lock
    try:
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    finally:
        lock.release()


def test_a_child_started_while_held_does_not_keep_the_lock_after_the_parent_dies(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", PARENT_WITH_CHILDREN, str(tmp_path)], cwd=REPO,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    children = [int(parent.stdout.readline()) for _ in range(2)]
    try:
        with pytest.raises(RunDirLockedError):
            DirLock.acquire(tmp_path)
        lock_file = str((tmp_path / LOCK_FILE).resolve())
        for child in children:
            fds = [os.readlink(f) for f in Path(f"/proc/{child}/fd").iterdir()]
            assert lock_file not in fds, (child, fds)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)
        assert all(_alive(child) for child in children)  # the children live on ...
        DirLock.acquire(tmp_path).release()  # ... without the lock
    finally:
        for pid in [parent.pid, *children]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        parent.wait(timeout=30)


def test_the_same_directory_for_logs_and_checkpoints_is_locked_once(tmp_path):
    with hold_run_dirs(tmp_path, tmp_path) as held:
        assert [lock.directory for lock in held] == [tmp_path.resolve()]
        proc = subprocess.run([sys.executable, "-c", HOLDER, str(tmp_path), str(tmp_path)], cwd=REPO,
                              capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert proc.stdout.startswith(f"error: {tmp_path.resolve()} (logger.log_dir and "
                                      f"checkpointing.checkpoint_dir) is in use by another run: pid {os.getpid()} ")
    assert not (tmp_path / LOCK_FILE).exists()


def test_nested_directories_are_each_locked(tmp_path):
    logs, ckpt = tmp_path, tmp_path / "ckpt"
    holder = _start_holder(logs, ckpt)
    try:
        free = tmp_path / "a-free"  # sorts before ckpt/: taken first, then given back when ckpt/ is refused
        for log_dir, ckpt_dir, refused in [(ckpt, None, ckpt), (free, ckpt, ckpt), (tmp_path / "z", logs, logs)]:
            with pytest.raises(RunDirLockedError) as info:
                with hold_run_dirs(log_dir, ckpt_dir):
                    pass
            assert info.value.directory == refused.resolve() and info.value.holder.pid == holder.pid
        assert free.is_dir() and not (free / LOCK_FILE).exists()
        DirLock.acquire(free).release()
    finally:
        _stop(holder)
    with hold_run_dirs(ckpt / "logs", None) as held:  # checkpointing off: the log dir alone
        assert [lock.directory for lock in held] == [(ckpt / "logs").resolve()]
        DirLock.acquire(tmp_path).release()


def test_a_directory_that_cannot_be_made_is_one_error_naming_it(tmp_path):
    from nemo_rl.utils.write_errors import RunWriteError

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(RunWriteError) as err:
        DirLock.acquire(blocker / "logs", ["logger.log_dir"])
    assert str(blocker / "logs") in str(err.value) and str(err.value).startswith("cannot write ")
