"""``StopSignals`` in real processes (docs/design.md §5.11): children keep the block, the driver's
listener takes the signal, a second one or the grace ends the process at once with 128 + signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from nemo_rl.utils.stop_signals import DUPLICATE_WINDOW_S, exit_status

# A driver: enters StopSignals, starts a child (which inherits the block), reports both pids, then
# waits for a stop. The stop goes to an event loop when ATTACH is set, else interrupts the main thread.
DRIVER = textwrap.dedent("""
    import asyncio, os, subprocess, sys, time
    from nemo_rl.utils.stop_signals import StopSignals
    grace, attach = float(sys.argv[1]), sys.argv[2] == "attach"
    with StopSignals(grace) as stops:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if attach:
            async def main():
                loop = asyncio.get_running_loop()
                stopped, usr1 = asyncio.Event(), []
                stops.attach(loop, lambda by: stopped.set(), lambda by: (usr1.append(by), print("snapshot", by, flush=True)))
                print(os.getpid(), child.pid, flush=True)  # ready: the loop takes the signals from here
                await stopped.wait()
                print("stop", stops.name, "child alive", child.poll() is None, flush=True)
                await asyncio.sleep(float(sys.argv[3]))  # a final snapshot that takes this long
            asyncio.run(main())
        else:
            try:
                print(os.getpid(), child.pid, flush=True)
                time.sleep(60)
            except KeyboardInterrupt:
                print("interrupted", stops.name, "child alive", child.poll() is None, flush=True)
        child.kill()
    print("done", flush=True)
""")


def _start(*args: str) -> tuple[subprocess.Popen, int, int]:
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    driver, child = map(int, proc.stdout.readline().split())
    return proc, driver, child


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(autouse=True)
def _linux_only():
    if not sys.platform.startswith("linux"):
        pytest.skip("signal masks and /proc: Linux")


def test_a_sigterm_to_every_process_reaches_only_the_driver_loop():
    proc, driver, child = _start("25", "attach", "0.5")
    os.killpg(proc.pid, signal.SIGTERM)  # driver and child at once, as Slurm sends it
    out, err = proc.communicate(timeout=30)
    assert "stop SIGTERM child alive True" in out, (out, err)
    assert out.strip().endswith("done") and proc.returncode == 0, (out, err)


def test_sigusr1_asks_for_a_snapshot_and_a_later_sigterm_stops():
    proc, driver, child = _start("25", "attach", "0.1")
    time.sleep(0.3)
    os.kill(driver, signal.SIGUSR1)
    time.sleep(0.3)
    assert _alive(driver) and _alive(child)
    os.kill(driver, signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert "snapshot SIGUSR1" in out and "stop SIGTERM" in out, (out, err)


def test_the_same_stop_delivered_twice_is_one_stop():
    # Slurm signals every process while the batch script forwards the signal: the driver gets it twice
    proc, driver, child = _start("25", "attach", "1.0")
    os.kill(driver, signal.SIGTERM)
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and out.strip().endswith("done"), (out, err)  # the "final snapshot" finished
    assert "the same stop delivered twice" in err and "exiting at once" not in err, err


def test_a_second_signal_exits_at_once_with_the_first_ones_status():
    proc, driver, child = _start("25", "attach", "30")  # the "final snapshot" would take 30 s
    os.kill(driver, signal.SIGTERM)
    time.sleep(DUPLICATE_WINDOW_S + 0.5)
    t0 = time.monotonic()
    os.kill(driver, signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert time.monotonic() - t0 < 5
    assert proc.returncode == exit_status(signal.SIGTERM) == 143, (out, err)
    assert "stopped by SIGTERM: a second SIGINT; exiting at once" in err, err
    assert "done" not in out
    os.kill(child, signal.SIGKILL)  # no reaper in this test: the harmless child goes here


def test_the_grace_running_out_exits_at_once():
    proc, driver, child = _start("1.0", "attach", "30")
    t0 = time.monotonic()
    os.kill(driver, signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert 0.9 < time.monotonic() - t0 < 10
    assert proc.returncode == 143 and "grace (rollout_checkpointing.stop_grace_s) ran out" in err, err
    os.kill(child, signal.SIGKILL)


def test_without_a_loop_a_stop_interrupts_the_main_thread_also_when_sigint_was_ignored():
    def ignore_sigint() -> None:  # a background job of a non-interactive shell
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    proc = subprocess.Popen([sys.executable, "-c", DRIVER, "25", "main"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=ignore_sigint)
    driver, child = map(int, proc.stdout.readline().split())
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole foreground group
    out, err = proc.communicate(timeout=30)
    assert "interrupted SIGINT child alive True" in out, (out, err)
    assert proc.returncode == 0 and "Traceback" not in err, err
