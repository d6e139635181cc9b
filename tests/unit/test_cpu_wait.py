"""The CPU-wait instrument of the benchmarks (examples/bench/cpu_wait.py): it names a run's processes,
reads the kernel's per-thread counters, and cuts them at each snapshot pause."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "bench"))
import cpu_wait  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="needs Linux schedstat")


def test_sample_names_a_gym_server_and_counts_its_cpu(tmp_path):
    """A real process that looks like a Gym server (its ``NEMO_GYM_CONFIG_PATH``) and burns a CPU for
    longer than the sampler runs: the sampler finds it by name, and its time on a CPU grows with the
    wall time sampled (a single thread: never faster than the clock; busy: most of it)."""
    burner = subprocess.Popen(
        [sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 8: pass"],
        env={**os.environ, "NEMO_GYM_CONFIG_PATH": "policy_model"})
    out = tmp_path / "cpu.jsonl"
    try:
        time.sleep(0.3)
        assert cpu_wait.process_name(burner.pid) == "gym:policy_model"
        assert cpu_wait.process_name(os.getpid()) is None  # pytest: not part of a run
        sampler = subprocess.Popen([sys.executable, cpu_wait.__file__, "sample", "--out", str(out), "--interval", "0.05"])
        time.sleep(2.5)
        sampler.terminate()
        assert sampler.wait(10) == 0
    finally:
        burner.kill()
        burner.wait()
    procs, _ = cpu_wait.load_samples(out)
    run, wait = procs[f"gym:policy_model@{burner.pid}"]
    wall_s = run.t[-1] - run.t[0]
    burned_s = (run.v[-1] - run.v[0]) / 1e9
    assert wall_s > 1.0 and 0.2 * wall_s < burned_s <= wall_s + 0.05, (burned_s, wall_s)
    assert wait.v[-1] >= wait.v[0]
    assert "sampler_cpu_s" in out.read_text().splitlines()[-1]  # what sampling cost, on the way out


def test_report_cuts_each_pause_and_adds_up_processes_of_one_name(tmp_path):
    """Two processes named alike (two replicas of one server) add up inside a pause; interpolation
    between samples; burst and steady attempts apart; a pause outside the samples is skipped."""
    samples = tmp_path / "cpu.jsonl"
    rows = []
    for i in range(11):  # t = 100.0 .. 101.0, every 0.1 s; each counter grows 1 ms of run / 2 ms of wait per 0.1 s
        t = 100.0 + i / 10
        row = {"t": t, "some_us": i * 50_000, "p": {"1": [i * 1_000_000, i * 2_000_000], "2": [i * 1_000_000, 0]}}
        if i == 0:
            row["n"] = {"1": "gym:agent", "2": "gym:agent"}
        rows.append(row)
    samples.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    run.mkdir()
    attempts = [{"event": "attempt", "start": 100.05, "pause_s": 0.2, "not_admitted": 5},  # burst
                {"event": "attempt", "start": 100.5, "pause_s": 0.4, "not_admitted": 0},   # steady
                {"event": "attempt", "start": 101.5, "pause_s": 0.1, "not_admitted": 0},   # not sampled
                {"event": "gym:prepare", "start": 100.5, "end": 100.6}]
    (run / "snapshot-timing.jsonl").write_text("".join(json.dumps(a) + "\n" for a in attempts))
    result = cpu_wait.report(samples, run)
    burst, steady = result["burst"], result["steady"]
    assert burst["pause ms"]["median"] == pytest.approx(200)
    assert burst["gym:agent: on a CPU ms"]["median"] == pytest.approx(4.0)  # two processes x 2 ms
    assert burst["gym:agent: waiting for one ms"]["median"] == pytest.approx(4.0)
    assert steady["gym:agent: waiting for one ms"]["median"] == pytest.approx(8.0)
    assert steady["gym:agent: waiting for one ms"]["n"] == 1  # the pause past the samples is not counted
    assert steady["pause ms"]["n"] == 2
    assert burst["cpu pressure (some) %"]["median"] == pytest.approx(50.0)


def test_report_names_a_missing_input_file(tmp_path, capsys):
    samples = tmp_path / "cpu.jsonl"
    samples.write_text("")
    with pytest.raises(SystemExit):
        cpu_wait.main(["report", str(samples), str(tmp_path / "no-run")])
    assert f"{tmp_path / 'no-run' / 'snapshot-timing.jsonl'}: no such file" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="cpu_wait.py sample"):
        cpu_wait.report(tmp_path / "missing.jsonl", tmp_path)
