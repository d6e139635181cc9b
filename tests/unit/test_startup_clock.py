"""startup.json: when the process started and where the time to the first rollout went."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from nemo_rl.utils.startup_clock import PHASES, StartupClock, process_start_time


def test_process_start_time_is_this_processes_start():
    # A child measures how long ago it started, right at its first line: Python's own start-up only.
    code = ("import time; now = time.time(); "
            "from nemo_rl.utils.startup_clock import process_start_time; print(now - process_start_time())")
    before = time.time()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    took = time.time() - before
    age = float(out.stdout)
    assert -0.02 <= age <= took, f"child started {age:.3f}s before its first line; the whole run took {took:.3f}s"
    assert process_start_time() <= time.time()


def test_phases_and_atomic_file(tmp_path):
    clock = StartupClock(tmp_path, resumed=True)
    for phase in PHASES[:-1]:
        clock.mark(phase)
    assert not (tmp_path / "startup.json").exists(), "written only at the first dispatch"
    clock.mark("first_dispatch")
    record = json.loads((tmp_path / "startup.json").read_text())
    assert record["resumed"] is True and set(record["phases_s"]) == set(PHASES)
    assert all(v >= 0 for v in record["phases_s"].values())
    assert record["to_first_dispatch_s"] == pytest.approx(sum(record["phases_s"].values()), abs=0.01)
    assert [p.name for p in tmp_path.iterdir()] == ["startup.json"], "no temp file is left behind"
    with pytest.raises(ValueError, match="unknown startup phase 'warmup'"):
        clock.mark("warmup")
