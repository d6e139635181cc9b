"""The parity comparison (``nemo_rl/parity/compare.py``) on two runs' records as a deterministic run writes
them (``trace.write_step_trace``, ``metrics.jsonl``, a trainer step's safetensors): equal runs pass; each
kind of difference fails and the first one is named by step, group, sample, call and token; what follows
the faults (timings, snapshot counts) is not compared; the surviving lineage of a step trained twice is
the one compared; async mode compares only samples made at the same weight versions."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from nemo_rl.parity.compare import Tolerance, compare_runs, render, tool_outputs
from nemo_rl.parity.faults import default_spec, parse_schedule
from nemo_rl.parity.trace import (
    TracedCall,
    TracedSample,
    read_step_trace,
    read_step_traces_steps,
    step_file,
    write_step_trace,
)

STEPS = 2


def _sample(group: str, sibling: int, seed: int, version: int = 0) -> TracedSample:
    prompt = [1, 2, 3, seed]
    gen0 = [10 + seed, 11, 12]
    tool = [40, 41 + seed]  # what the tool answered before the second call
    gen1 = [20, 21 + sibling]
    calls = [TracedCall(prompt + gen0, [0] * 4 + [1] * 3, [-0.5, -0.25, -0.125], version),
             TracedCall(prompt + gen0 + tool + gen1, [0] * 9 + [1] * 2, [-1.0, -0.75], version)]
    return TracedSample(group, sibling, f"{group}_g{sibling}_a{seed:04x}", float(sibling), 0.5 - sibling, calls)


def _steps() -> dict[int, list[TracedSample]]:
    return {s: [_sample(f"s{s}p{p}", k, seed=10 * s + p) for p in (0, 1) for k in (0, 1)] for s in range(1, STEPS + 1)}


def _write(root: Path, steps: dict[int, list[TracedSample]], *, timing: float = 1.0, loss: float = 0.25,
           weights: torch.Tensor | None = None) -> tuple[Path, Path]:
    logs, ckpt = root / "logs", root / "ckpt"
    logs.mkdir(parents=True)
    rows = []
    for step, samples in steps.items():
        write_step_trace(logs, step, samples)
        rows.append({"step": step, "loss": loss * step, "grad_norm": 0.5, "generation_s": timing,
                     "snapshots_committed": int(timing), "supervisor/rows": timing, "gen_fleet/restart_attempts/0": timing,
                     "groups": sorted({s.group_id for s in samples})})
    (logs / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (ckpt / f"step_{STEPS}").mkdir(parents=True)
    w = torch.arange(6, dtype=torch.float32) if weights is None else weights
    save_file({"model.w": w, "model.b": torch.ones(2)}, str(ckpt / f"step_{STEPS}" / "model.safetensors"))
    return logs, ckpt


def _compare(tmp_path: Path, faulted: dict[int, list[TracedSample]], **write_kw):
    ref = _write(tmp_path / "ref", _steps())
    run = _write(tmp_path / "run", faulted, **write_kw)
    return compare_runs(*ref, *run, steps=STEPS)


def test_equal_runs_pass_and_what_follows_the_faults_is_not_compared(tmp_path):
    report = _compare(tmp_path, _steps(), timing=9.0)  # other timings and snapshot counts
    text = render(report)
    assert report.ok and report.first is None, text
    assert report.weights.exact and "final weights (step_2): exact, 2 tensors" in text
    assert all(r.token_ids == r.masks == r.rewards == "exact" and r.tool_effects == 4 for r in report.rows)
    assert text.splitlines()[-1] == "PARITY: ok"


def test_a_changed_token_is_named_by_step_group_sample_call_and_token(tmp_path):
    steps = _steps()
    steps[2][3].calls[1].token_ids[10] = 999  # step 2, group s2p1, sibling 1, call 1: a generated token
    report = _compare(tmp_path, steps)
    first = report.first
    assert not report.ok
    assert (first.step, first.group, first.sample, first.call, first.token, first.what) == (
        2, "s2p1", 1, 1, 10, "token id")
    assert (first.reference, first.faulted) == (22, 999)
    text = render(report)
    assert "first difference: step 2, group s2p1, sample 1 (s2p1_g1_a0015), call 1, token 10: token id" in text
    assert text.splitlines()[-1] == "PARITY: FAILED"
    assert [r.verdict for r in report.rows] == ["ok", "DIFFERS"]


def test_a_tool_answer_applied_twice_shows_in_what_the_tools_answered(tmp_path):
    steps = _steps()
    s = steps[1][1]
    s.calls[1].token_ids[8] += 1  # the session's answer before call 1 differs (an id advanced twice)
    assert tool_outputs(steps[1][0]) == [[40, 51]]
    report = _compare(tmp_path, steps)
    assert report.first.what == "token id (in what the tools answered before this call)"
    assert (report.first.step, report.first.sample, report.first.call, report.first.token) == (1, 1, 1, 8)


def test_logprobs_within_tolerance_pass_and_beyond_it_fail(tmp_path):
    steps = _steps()
    steps[1][0].calls[0].logprobs[1] += 5e-7  # atol 1e-6
    assert _compare(tmp_path / "a", steps).ok
    steps[1][0].calls[0].logprobs[1] += 1e-3
    report = _compare(tmp_path / "b", steps)
    assert (report.first.what, report.first.call, report.first.token) == ("logprob", 0, 5)  # after a 4-token prompt
    assert report.rows[0].logprobs_max == pytest.approx(1e-3 + 5e-7)
    assert Tolerance(rtol=0, atol=1e-2).close(1.0, 1.005)


def test_rewards_masks_order_and_groups_are_exact(tmp_path):
    cases = {
        "reward": lambda st: setattr(st[1][2], "reward", 0.5),
        "loss mask": lambda st: st[1][2].calls[0].loss_mask.__setitem__(3, 1),
        "sample order": lambda st: st[2].__setitem__(slice(0, 2), [st[2][1], st[2][0]]),
        "groups trained differ at group 1": lambda st: st[2].__setitem__(
            slice(2, 4), [_sample("s2p9", k, seed=3) for k in (0, 1)]),
        "advantage": lambda st: setattr(st[1][0], "advantage", 0.75),
    }
    for i, (what, mutate) in enumerate(cases.items()):
        steps = _steps()
        mutate(steps)
        report = _compare(tmp_path / str(i), steps)
        assert report.first is not None and report.first.what == what, (what, report.first)


def test_metrics_follow_tolerance_and_missing_records_are_named(tmp_path):
    report = _compare(tmp_path / "a", _steps(), loss=0.25 + 1e-3)
    assert report.first.what == "metric loss" and report.first.step == 1
    steps = _steps()
    del steps[2]
    report = _compare(tmp_path / "b", steps)
    assert report.first.step == 2 and "no trained-samples record" in report.first.what


def test_final_weights_must_be_equal_bit_for_bit(tmp_path):
    report = _compare(tmp_path, _steps(), weights=torch.arange(6, dtype=torch.float32) + torch.tensor(
        [0, 0, 0, 1e-6, 0, 0]))
    assert not report.ok and report.first is None
    assert report.weights.worst == "model.w" and 0 < report.weights.max_abs < 1e-5
    assert "final weights (step_2): DIFFER, largest |d|" in render(report)


def test_a_step_trained_twice_is_compared_as_the_lineage_that_survived(tmp_path):
    steps = _steps()
    ref = _write(tmp_path / "ref", steps)
    wrong = copy.deepcopy(steps)
    wrong[2][0].reward = 7.0
    run = _write(tmp_path / "run", wrong)  # the lost lineage's step 2 ...
    write_step_trace(run[0], 2, steps[2])  # ... replaced when the relaunch trained it again
    assert read_step_trace(step_file(run[0], 2)).samples == steps[2]
    assert read_step_traces_steps(run[0]) == [1, 2]
    assert compare_runs(*ref, *run, steps=STEPS).ok


def test_async_compares_only_samples_of_the_same_versions_and_stops_where_weights_part(tmp_path):
    steps = _steps()
    for c in steps[1][3].calls:
        c.weight_version = 1  # made after a refit in one run, before it in the other
    ref = _write(tmp_path / "ref", _steps())
    run = _write(tmp_path / "run", steps)
    report = compare_runs(*ref, *run, steps=STEPS, async_mode=True)
    assert report.first is None and report.not_comparable_from == 2
    assert report.rows[0].versions == "3/4" and report.rows[1].verdict == "not comparable"
    assert report.weights is None and any("from step 2 on" in n for n in report.notes)
    assert "same versions" in render(report)


def test_fault_specs_are_parsed_and_bad_ones_named():
    schedule = parse_schedule("kill, term:replicas=1,server:policy_model@nemo_gym/replica-0,stop,replica,worker", 3)
    kinds = [(f.kind, f.server, f.replica, f.replicas) for f in schedule.faults]
    assert kinds == [("kill", None, None, None), ("term", None, None, 1),
                     ("server", "policy_model", "nemo_gym/replica-0", None), ("stop", None, None, None),
                     ("replica", None, None, None), ("worker", None, None, None)]
    assert all(f.after_snapshots in (1, 2) and f.after_steps == 0 for f in schedule.faults)
    spread = parse_schedule("kill,kill,kill,kill,kill,kill", 5, steps=4).faults
    assert [f.after_steps for f in spread] == sorted(f.after_steps for f in spread)  # in order
    assert {f.after_steps for f in spread} <= {0, 1, 2, 3} and len({f.after_steps for f in spread}) > 1
    assert [f.after_snapshots for f in parse_schedule("kill,kill,kill,kill", 3).faults] == \
        [f.after_snapshots for f in parse_schedule("kill,kill,kill,kill", 3).faults]  # drawn from the seed
    assert [f.kind for f in parse_schedule(default_spec(2)).faults] == [
        "server", "replica", "kill", "worker", "stop", "kill", "term"]
    assert parse_schedule(default_spec(2)).faults[-1].replicas == 1
    assert parse_schedule(default_spec(1)).faults[-1].replicas == 2
    for bad, says in (("explode", "unknown fault 'explode'"), ("kill:replicas=0", "replicas=<N >= 1>"),
                      ("worker:x", "takes no argument"), ("kill@nemo_gym/replica-0", "only server, stop and replica"),
                      ("", "no fault given")):
        with pytest.raises(ValueError, match="--faults") as err:
            parse_schedule(bad)
        assert says in str(err.value)
