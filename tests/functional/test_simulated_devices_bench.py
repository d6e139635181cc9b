"""Smoke test of ``examples/bench/simulated_devices.py``: the ``simulated_devices_smoke`` preset, run as
the lead runs the full one (a subprocess of the script), prints its table and writes its results, and
its real GRPO runs used both stand-ins (lower bounds on what they must have slept, never timing goals)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "bench" / "simulated_devices.py"
sys.path.insert(0, str(REPO / "examples"))

from bench import simulated_devices  # noqa: E402

pytestmark = [pytest.mark.functional, pytest.mark.timeout(600)]


def test_the_smoke_preset_runs_and_prints_its_table(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--preset", "simulated_devices_smoke", "--out", str(out),
                           "--workdir", str(tmp_path / "work")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| mode | steps / hour (steps 2–N) |" in proc.stdout and "| async |" in proc.stdout
    assert "ideal (g + t) / max(g, t)" in proc.stdout and "Async on simulated devices:" in proc.stdout
    assert "1-minute load average around the runs" in proc.stdout
    res = json.loads((out / "simulated_devices.json").read_text())["result"]
    assert (out / "simulated_devices.md").read_text().count("| sync |") == 1
    assert (out / "simulated_devices.png").stat().st_size > 1000

    params = simulated_devices.PRESETS["simulated_devices_smoke"]
    runs = {w["mode"]: w for w in res["runs"]}
    assert set(runs) == {"sync", "async"} and res["calibration"] is None  # the preset fixes the stand-in's time
    per_step = params["prompts"] * params["generations"]
    for mode, w in runs.items():
        assert w["stragglers"] == [] and w["steps"] == params["steps"] and w["measured_steps"] == params["steps"] - 1
        assert "policy.model_name=scripted-test-backend" in w["command"]
        assert f"policy.scripted_backend.tokens_per_s={params['tokens_per_s']:g}" in w["command"]
        assert f"policy.simulated_trainer.seconds_per_sample={params['seconds_per_sample']:g}" in w["command"]
        lookahead = 1 if mode == "async" else 0
        assert f"async_rl.sampler.max_lookahead_versions={lookahead}" in w["command"]
        assert w["max_group_version_lag"] <= lookahead
        for step in w["per_step"]:  # the trainer stand-in slept for every sample it trained
            assert step["num_samples"] == per_step and step["training_s"] >= per_step * params["seconds_per_sample"]
    # The generation stand-in: step 1 waits for every token of its rollouts at the device's rate (a Workplace
    # rollout's replies are 100-170 fake tokens; 50 a rollout is a safe floor).
    assert all(w["per_step"][0]["generation_s"] >= per_step * 50 / params["tokens_per_s"] for w in runs.values())
    (pair,) = res["pairs"]
    assert math.isclose(pair["measured"], runs["async"]["steps_per_hour"] / runs["sync"]["steps_per_hour"])
    g, t = runs["sync"]["generation_s"], runs["sync"]["training_s"]
    assert math.isclose(pair["ideal"], (g + t) / max(g, t)) and math.isclose(pair["ratio"],
                                                                               pair["measured"] / pair["ideal"])
    assert res["goal"]["ratio_met"] in (True, False) and res["goal"]["share_in_range"] in (True, False)
