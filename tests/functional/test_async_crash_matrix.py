"""The crash matrix in async mode (lookahead 1), on real crashed runs, one replica and 2 shards x 2 replicas.

Each setup (``grpo_mixed_turn.yaml``; ``grpo_mixed_two_shards_turn.yaml`` with its
restart-only servers, ``allow_restart_only_gym_servers=true`` as ``RunSpec``
sets) is SIGKILLed by the test-only hook at one of three points of step 2, then
the same command runs to the end:

- ``train:2``: the trainer has consumed step 2's groups (it trained them
  streaming while step 3's groups generated);
- ``refit:2``: step 2 trained, its weights about to go to generation, step 3's
  rollouts in flight;
- ``checkpointed:2``: step 2's trainer checkpoint just published, no snapshot
  under it yet, so the rerun takes step 2 with the newest snapshot of step 1.

The step shape (``cm.RunSpec.async_overrides``: 1.5 steps of groups generating
at once, the data in file order) makes every kill land where it means
something: half of step 2's groups are complete before step 1 is durable (a
snapshot under step 1 holds them complete: the rerun re-trains them), step 3's
groups generate across step 2, each step holds a row whose servers save turns.
Every run must end with each group trained exactly once, what the rerun
continued at turn level continued at attempt 1, and no step trained a group
more than one weight version old (the killed run's rows and the rerun's).

``checkpointed:1`` (one replica) is the same point at the first checkpoint: the
older anchor is ``bootstrap/``, which stays until ``checkpointing.keep_top_k``
steps exist, so its snapshots still continue what they saved.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import pytest

from tests.functional.rl_run import load_crash_matrix

pytestmark = [pytest.mark.functional, pytest.mark.timeout(420)]

cm = load_crash_matrix()
SETUPS = {"one_replica": cm.MIXED_CONFIG, "two_shards": cm.TWO_SHARDS_CONFIG}
KILLS = ("train:2", "refit:2", "checkpointed:2")
SPEC = dict(steps=3, **cm.ASYNC_SHAPE)  # lookahead 1, file order, 0.25 s snapshots, 0.6 s replies
LAG_LIMIT = 1  # the lookahead
CASES = [pytest.param(setup, kill, id=f"{setup}-{kill}") for setup in SETUPS for kill in KILLS]
_TARGET = re.compile(r"^s(?P<target>[0-9]+)p[0-9]+_")


@dataclass
class Crashed:
    """One setup killed at one point, then run to the end."""

    spec: "cm.RunSpec"
    first: "cm.RunResult"
    killed_metrics: list[dict[str, Any]]  # metrics.jsonl rows the killed run wrote
    killed_snapshots: list[tuple[int, int, int]]  # (step, anchor_step, saved) of each snapshot it committed
    final: "cm.RunResult"

    @property
    def restore(self) -> dict[str, Any]:
        assert self.final.restore is not None, "the rerun wrote no restore.json"
        return self.final.restore


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """``crashed(setup, kill)``: the runs of that case, made once per module on first use (a case
    whose runs went wrong fails every test of it with the same message, without running again)."""
    done: dict[tuple[str, str], Crashed | str] = {}

    def run(setup: str, kill: str) -> Crashed | str:
        root = tmp_path_factory.mktemp(f"{setup}-{kill.replace(':', '-')}")
        spec = cm.RunSpec(root, config=SETUPS[setup], **SPEC)
        runner = cm.Runner(spec, log=lambda _: None)
        first = runner.run(crash=kill)
        if not first.crashed_by_hook:
            return f"{setup}: the {kill} hook did not fire (exit {first.returncode}): {first.stderr[-2000:]}"
        killed_metrics = spec.records("metrics.jsonl")
        snapshots = [(s["step"], s["anchor_step"], s["saved"]) for s in spec.records("snapshots.jsonl")
                     if s.get("committed")]
        final = runner.run()
        if final.returncode != 0:
            return f"{setup}: the rerun after {kill} exited {final.returncode}: {final.stderr[-3000:]}"
        return Crashed(spec, first, killed_metrics, snapshots, final)

    def get(setup: str, kill: str) -> Crashed:
        if (setup, kill) not in done:
            done[setup, kill] = run(setup, kill)
        case = done[setup, kill]
        if isinstance(case, str):
            pytest.fail(case)
        return case

    return get


def _targets(rollout_ids: list[str]) -> set[int]:
    return {int(m["target"]) for r in rollout_ids if (m := _TARGET.match(r))}


# ------------------------------------------------------------------------------ each case
@pytest.mark.parametrize(("setup", "kill"), CASES)
def test_every_group_is_trained_exactly_once(crashed, setup, kill):
    case = crashed(setup, kill)
    assert cm.check_lineage(case.spec) == []
    trained = cm.trained_rollout_ids(case.spec)
    assert cm.check_restore(case.restore, trained, final=True) == []
    for run in (case.first, case.final):
        assert run.leftover == [] and run.cleanup_s < cm.ORPHAN_GRACE_S, (run.index, run.leftover, run.cleanup_s)


@pytest.mark.parametrize(("setup", "kill"), CASES)
def test_the_kill_landed_with_later_steps_rollouts_in_flight(crashed, setup, kill):
    """Step 1 ended with step 2's and 3's rollouts generating, and the snapshot the rerun restored
    (taken under step 1, before the kill) holds rollouts of step 3 still generating: they ran while
    step 2 trained, refitted and checkpointed."""
    case = crashed(setup, kill)
    assert [row["step"] for row in case.killed_metrics] == [1], case.killed_metrics
    assert case.killed_metrics[-1]["inflight_rollouts"] > 0, case.killed_metrics[-1]
    r = case.restore
    assert r["snapshot"] is not None and r["snapshot_anchor_step"] == 1, (r, case.killed_snapshots)
    in_flight = r["restored_rollout_ids"] + r["restarted_rollout_ids"]
    assert 3 in _targets(in_flight), in_flight


@pytest.mark.parametrize(("setup", "kill"), CASES)
def test_the_rerun_continues_saved_rollouts_at_the_next_attempt(crashed, setup, kill):
    case = crashed(setup, kill)
    r = case.restore
    assert r["snapshot"] is not None, (r, case.killed_snapshots)
    assert r["restored_turn"] > 0 and r["restored_turn"] == len(r["restored_rollout_ids"]), r
    assert all(i.endswith("-a1") for i in r["restored_rollout_ids"]), r["restored_rollout_ids"]


@pytest.mark.parametrize(("setup", "kill"), CASES)
def test_no_step_trains_a_group_more_than_the_lookahead_behind(crashed, setup, kill):
    case = crashed(setup, kill)
    assert cm.check_version_lag(case.spec, LAG_LIMIT) == []
    rows = [row for row in case.spec.records("metrics.jsonl") if "max_group_version_lag" in row]
    rerun = rows[len(case.killed_metrics):]
    trained_by_rerun = [row["step"] for row in rerun if not row.get("row_restored")]
    assert trained_by_rerun == list(range(case.restore["trainer_step"] + 1, SPEC["steps"] + 1)), rows
    if kill.startswith("checkpointed"):  # step 2 was durable, its row not written: the rerun writes it
        assert [row["step"] for row in rerun if row.get("row_restored")] == [2], rows
    assert max(row["max_group_version_lag"] for row in rows) == LAG_LIMIT, rows  # async: some group ran ahead


@pytest.mark.parametrize("setup", SETUPS)
def test_a_kill_after_a_checkpoint_restores_a_snapshot_of_the_older_anchor(crashed, setup):
    """Step 2 durable, no snapshot under it: step 1's newest snapshot, less the groups step 2 trained."""
    r = crashed(setup, "checkpointed:2").restore
    assert r["trainer_step"] == 2 and r["snapshot_anchor_step"] < r["trainer_step"], r
    assert f"/step_{r['snapshot_anchor_step']}/rollout_snapshots/" in r["snapshot"], r
    assert isinstance(r["dropped_trained_groups"], int) and r["dropped_trained_groups"] >= 0, r
    continued = r["restored_rollout_ids"] + r["restarted_rollout_ids"] + r["kept_rollout_ids"]
    assert _targets(continued) == {3}, continued  # nothing of step 2 comes back


def test_a_kill_after_the_first_checkpoint_restores_a_bootstrap_snapshot(crashed):
    """Step 1 durable, no snapshot under it: the newest under ``bootstrap/`` (kept while fewer than
    keep_top_k steps exist) continues step 2's and 3's saved rollouts; step 1's groups are dropped."""
    case = crashed("one_replica", "checkpointed:1")
    r = case.restore
    assert r["trainer_step"] == 1 and r["snapshot_anchor_step"] == 0, r
    assert "/bootstrap/rollout_snapshots/" in r["snapshot"], r
    assert r["restored_turn"] > 0 and all(i.endswith("-a1") for i in r["restored_rollout_ids"]), r
    continued = r["restored_rollout_ids"] + r["restarted_rollout_ids"] + r["kept_rollout_ids"]
    assert 1 not in _targets(continued), continued
    assert cm.check_lineage(case.spec) == []
    assert cm.check_restore(r, cm.trained_rollout_ids(case.spec), final=True) == []
    assert cm.check_version_lag(case.spec, LAG_LIMIT) == []


@pytest.mark.parametrize("kill", ("train:2", "refit:2"))
def test_a_killed_step_is_trained_again_from_sealed_samples(crashed, kill):
    """The restored snapshot under step 1 holds step-2 groups complete (their samples sealed; the
    half of step 2 that generated with step 1): the rerun trains step 2 from them instead of
    generating them again. By the step shape this holds on both setups."""
    retrained = {setup: crashed(setup, kill).restore["retrained_groups"] for setup in SETUPS}
    assert all(n > 0 for n in retrained.values()), retrained


# ------------------------------------------------------------------------------ the checks can fail
def test_version_lag_check_catches_a_stale_group_and_a_run_without_rows(tmp_path):
    spec = cm.RunSpec(tmp_path, lookahead=1)
    assert cm.check_version_lag(spec, 1) == [f"no metrics row in {spec.logs / 'metrics.jsonl'} has "
                                             "max_group_version_lag"]
    spec.logs.mkdir(parents=True)
    rows = [{"step": 0, "val_reward_mean": 1.0}, {"step": 1, "max_group_version_lag": 0},
            {"step": 2, "max_group_version_lag": 2, "row_restored": True}]
    (spec.logs / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cm.check_version_lag(spec, 2) == []
    assert cm.check_version_lag(spec, 1) == ["step 2 (restored row): max_group_version_lag 2 > 1"]


def test_phase_counts_and_async_overrides():
    assert cm.parse_phase("refit") == ("refit", 2) and cm.parse_phase("checkpointed:3") == ("checkpointed", 3)
    assert cm.parse_phase("between") == ("between", None)
    for bad in ("refit:0", "train:x", "restore:2", "flush"):
        with pytest.raises(ValueError, match=re.escape(bad.partition(":")[0])):
            cm.parse_phase(bad)
    args = cm.RunSpec("/x", lookahead=1, shuffle=False).args()
    assert args[:2] == ["--config", cm.MIXED_CONFIG]
    for key in ("async_rl.sampler.max_lookahead_versions=1", "grpo.use_generation_logprobs=true",
                "async_rl.min_groups_for_streaming_train=2", "async_rl.max_inflight_prompts=6",
                "async_rl.max_buffered_rollouts=32", "data.shuffle=false"):
        assert key in args, (key, args)
    assert not any(a.startswith(("async_rl.", "data.shuffle")) for a in cm.RunSpec("/x").args())
