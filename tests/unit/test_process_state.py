"""``process_state``: what the Gym actor reads to tell a busy server from a hung or stopped one
when a status probe goes unanswered (docs/design.md §5.8). Real child processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from gym_patches.utils.processes import process_state


def _cpu_share(pid: int, window_s: float = 0.6) -> float:
    before = process_state(pid)
    time.sleep(window_s)
    after = process_state(pid)
    assert before is not None and after is not None
    return (after[1] - before[1]) / window_s


def test_a_busy_process_uses_cpu_a_waiting_one_does_not_and_a_stopped_one_says_so():
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    wait = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.3)
        assert _cpu_share(spin.pid) >= 0.1  # well above the actor's BUSY_CPU_SHARE on a loaded machine too
        assert _cpu_share(wait.pid) < 0.05
        assert process_state(wait.pid)[0] == "S"
        spin.send_signal(signal.SIGSTOP)
        time.sleep(0.2)
        assert process_state(spin.pid)[0] == "T"
        assert _cpu_share(spin.pid) < 0.05
    finally:
        for proc in (spin, wait):
            proc.kill()
            proc.wait()
    assert process_state(spin.pid) is None  # reaped: gone
