"""Elastic restore on real crashed runs (docs/design.md §5.7): a relaunch on fewer or more Gym replicas.

The run is SIGKILLed (whole process group) once a committed snapshot holds turn-level rollouts saved
on a replica the relaunch will not start; the relaunch changes only the shard's ``replicas``, with no
other flag. Checked: it resumes; ``restore.json`` records the change (``resharded``) and lists every
rollout saved on a vanished replica as moved to a survivor (``moved_rollouts``), continued there at
attempt + 1 from its saved turn; the final lineage trains every prompt group exactly once with the
rewards a crash-free run gets (a rollout continued from a wrong boundary would change its reward,
see ``examples/crash_matrix.py``). A renamed or removed shard is refused by name before anything
starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gym_patches.checkpoint.identity import EpisodeId, next_attempt
from tests.functional.rl_run import RunDirs, env_for, load_crash_matrix, run_grpo, run_until_then_kill

pytestmark = [pytest.mark.functional, pytest.mark.timeout(420)]

cm = load_crash_matrix()
ONE_SHARD = "examples/configs/grpo_workplace_two_replicas_turn.yaml"  # shard nemo_gym, 2 replicas
SPEC = dict(steps=2, prompts=4, generations=4, interval_s=0.25, delay_s=0.4, keep_latest_k=50, shuffle=False)


def _spec(root: Path, config: str, *replicas: int) -> "cm.RunSpec":
    """The same command but for the replica count of each shard (in config order)."""
    return cm.RunSpec(root, config=config, **SPEC,
                      extra=[f"env.nemo_gym.shards.{i}.replicas={n}" for i, n in enumerate(replicas)])


def _newest_saving_on(spec: "cm.RunSpec", replica: str, step: int) -> bool:
    """The newest committed snapshot (cut at controller step >= ``step``: 0 while step 1 generates) saved
    turn-level rollouts on ``replica``."""
    rows = [r for r in spec.records("snapshots.jsonl") if r.get("committed") and r.get("path")]
    if not rows or rows[-1].get("step", 0) < step:
        return False
    try:
        index = json.loads((Path(rows[-1]["path"]) / "gym_checkpoint.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(index["turn_level"].get(replica))


def _kill_when_saved_on(spec: "cm.RunSpec", replica: str, step: int):
    return lambda _elapsed: _newest_saving_on(spec, replica, step)


def _saved_turn_level(snapshot: str) -> dict[str, list[str]]:
    return json.loads((Path(snapshot) / "gym_checkpoint.json").read_text())["turn_level"]


def _check_moves(restore: dict, vanished: list[str], survivors: list[str]) -> list[str]:
    """Every rollout the restored snapshot saved on a vanished replica moved to a survivor at attempt + 1;
    the others stayed home. Returns the moved keys (the dealing order is unit-tested)."""
    saved = _saved_turn_level(restore["snapshot"])
    moved = restore["moved_rollouts"]
    expected = {}
    for source in vanished:
        for key in saved.get(source, []):
            expected[next_attempt(EpisodeId.from_capture_key(key)).capture_key] = source
    assert set(moved) == set(expected), (sorted(moved), sorted(expected))
    assert {k: m["from"] for k, m in moved.items()} == expected
    assert all(m["to"] in survivors for m in moved.values()), moved
    assert all(restore["restored_instances"][k] == m["to"] for k, m in moved.items())
    assert set(moved) <= set(restore["restored_rollout_ids"])
    home = {k: iid for k, iid in restore["restored_instances"].items() if k not in moved}
    for key, iid in home.items():
        saved_key = EpisodeId.from_capture_key(key)
        prior = EpisodeId(rollout_id=saved_key.rollout_id, attempt=saved_key.attempt - 1).capture_key
        assert prior in saved[iid], (key, iid)
    return sorted(moved)


def _check_lineage(spec: "cm.RunSpec", *records: dict) -> set[str]:
    assert cm.check_lineage(spec) == []
    trained = cm.trained_rollout_ids(spec)
    for record in records:
        assert cm.check_restore(record, trained, final=record is records[-1]) == []
    return trained


def test_two_replicas_to_one_and_back_to_two(tmp_path):
    root = tmp_path / "run"
    two, one = _spec(root, ONE_SHARD, 2), _spec(root, ONE_SHARD, 1)

    first = cm.Runner(two, log=lambda _: None).run(kill_when=_kill_when_saved_on(two, "nemo_gym/replica-1", 0))
    assert first.killed_by == "group", (first.returncode, first.stderr[-2000:])

    # One replica, no other flag: replica-1's saved rollouts continue on replica-0.
    second = cm.Runner(one, log=lambda _: None).run(kill_when=_kill_when_saved_on(one, "nemo_gym/replica-0", 1))
    assert second.killed_by == "group", (second.returncode, second.stderr[-2000:])
    r2 = second.restore
    assert r2 is not None and r2["snapshot"] is not None, second.stderr[-3000:]
    assert r2["resharded"] == {"nemo_gym": {"from": 2, "to": 1}}
    moved = _check_moves(r2, ["nemo_gym/replica-1"], ["nemo_gym/replica-0"])
    assert moved
    assert r2["not_portable_rollouts"] == {}
    print(f"2 -> 1: {len(moved)} moved, {r2['restored_turn']} continued at turn level, "
          f"{r2['restarted_from_prompt']} from the prompt, {r2['kept_siblings']} kept")
    assert "continue on their shard's others" in second.stdout

    # Two replicas again: nothing vanished, every saved rollout goes home (replica-0).
    third = cm.Runner(two, log=lambda _: None).run()
    assert third.returncode == 0, third.stderr[-3000:]
    r3 = third.restore
    assert r3["resharded"] == {"nemo_gym": {"from": 1, "to": 2}}
    assert r3["moved_rollouts"] == {}
    assert r3["restored_turn"] > 0 and set(r3["restored_instances"].values()) == {"nemo_gym/replica-0"}
    print(f"1 -> 2: {r3['restored_turn']} continued at turn level on replica-0, "
          f"{r3['restarted_from_prompt']} from the prompt")
    trained = _check_lineage(two, r2, r3)
    assert set(moved) <= trained  # the moved rollouts finished on replica-0 and were trained


def test_two_shards_of_two_replicas_to_one_each_and_a_removed_shard_is_refused(tmp_path):
    root = tmp_path / "run"
    wide, narrow = _spec(root, cm.TWO_SHARDS_CONFIG, 2, 2), _spec(root, cm.TWO_SHARDS_CONFIG, 1, 1)
    first = cm.Runner(wide, log=lambda _: None).run(kill_when=_kill_when_saved_on(wide, "saving/replica-1", 0))
    assert first.killed_by == "group", (first.returncode, first.stderr[-2000:])

    # A renamed or removed shard: refused by name before anything starts, saying what to do.
    renamed = run_grpo(narrow.args() + ["env.nemo_gym.shards.1.name=sandbox"], env=env_for())
    assert renamed.returncode == 1
    assert "Gym shard 'mixed' was renamed to 'sandbox'" in renamed.stderr and "name it 'mixed' again" in renamed.stderr
    removed = run_grpo(narrow.args() + [
        "env.nemo_gym.shards=[{name: saving, replicas: 1, config_paths: [examples/gym_configs/saving_shard.yaml]}]"],
        env=env_for())
    assert removed.returncode == 1
    assert "Gym shard 'mixed' (agents [" in removed.stderr and "nowhere to run" in removed.stderr
    assert "put it back under that name" in removed.stderr
    assert "Gym ready" not in renamed.stdout + removed.stdout

    final = cm.Runner(narrow, log=lambda _: None).run()
    assert final.returncode == 0, final.stderr[-3000:]
    record = final.restore
    assert record["resharded"] == {"saving": {"from": 2, "to": 1}, "mixed": {"from": 2, "to": 1}}
    moved = _check_moves(record, ["saving/replica-1"], ["saving/replica-0"])
    assert moved
    # the mixed shard saves nothing (restart-only): its rollouts restart from the prompt, siblings kept
    assert not _saved_turn_level(record["snapshot"]).get("mixed/replica-1")
    print(f"2x2 -> 2x1: {len(moved)} moved, {record['restored_turn']} continued at turn level, "
          f"{record['restarted_from_prompt']} from the prompt, {record['kept_siblings']} kept")
    trained = _check_lineage(narrow, record)
    assert set(moved) <= trained


# ------------------------------------------------------------------------------ prefix: a cut moves with its episode
@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    from tests.model_fixtures import llama_dir

    return llama_dir(tmp_path_factory.mktemp("model") / "my-llama")


def _newest_cut_on(dirs: RunDirs, replica: str) -> bool:
    """The newest committed snapshot holds a generation cut of a rollout saved on ``replica``."""
    rows = [r for r in dirs.records("snapshots.jsonl") if r.get("committed") and r.get("path")]
    if not rows or not rows[-1].get("cuts"):
        return False
    try:
        index = json.loads((Path(rows[-1]["path"]) / "gym_checkpoint.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(index.get("cut_tokens", {}).get(replica))


@pytest.mark.timeout(900)
def test_prefix_two_shards_of_two_replicas_to_one_each_continues_moved_cuts(llama, tmp_path):
    """``target_level: prefix`` on the torch worker (the scripted backend has no cuts): a rollout whose model
    call was cut on a vanished replica continues on the survivor from the cut's tokens, exactly once."""
    from tests.functional.test_prefix_recovery import PROMPTS, _args, _previous_key, _saved_cuts, assert_held, held_env

    dirs = RunDirs(tmp_path)
    # The killed run's generation worker holds each batch mid-decode until two snapshots' cuts pinned it
    # (held_env): the newest committed snapshot holds a cut on replica-1 on any machine, and the kill comes
    # at the first; the relaunch runs without the hold.
    steps = 2
    overrides = {"grpo.max_num_steps": steps, "rollout_checkpointing.snapshot_attempt_interval_s": 0.1}
    wide = [f"{a.split('=')[0]}={overrides[a.split('=')[0]]}" if a.split("=")[0] in overrides else a
            for a in _args(dirs, llama)]
    run_until_then_kill(wide, env=held_env(), until=lambda: _newest_cut_on(dirs, "saving/replica-1"), timeout_s=400)
    assert_held(dirs.logs)
    # the cuts of every published snapshot, read now: the relaunch prunes the one it restores once newer
    # trainer steps are published
    saved = {row["path"]: _saved_cuts(Path(row["path"])) for row in dirs.records("snapshots.jsonl")
             if row.get("committed") and row.get("path") and Path(row["path"]).is_dir()}
    proc = run_grpo(wide + ["env.nemo_gym.shards.0.replicas=1", "env.nemo_gym.shards.1.replicas=1"], env=env_for(),
                    timeout_s=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    restore = dirs.restore_record()
    assert restore["resharded"] == {"saving": {"from": 2, "to": 1}, "mixed": {"from": 2, "to": 1}}
    moved = restore["moved_rollouts"]
    cuts = saved[restore["snapshot"]]
    moved_cut = {k: n for k, n in restore["restored_prefix_tokens"].items() if k in moved}
    assert moved_cut, (sorted(moved), restore["restored_prefix_tokens"])
    assert all(moved[k] == {"from": "saving/replica-1", "to": "saving/replica-0"} for k in moved_cut)
    continued = [c for r in dirs.records("metrics.jsonl") for c in r.get("prefix_continuations", [])]
    for key, tokens in moved_cut.items():
        cut = cuts[_previous_key(key)]
        uses = [c for c in continued if c["call_id"] == cut.call_id]
        assert len(uses) == 1 and uses[0]["rollout_id"] == key, (key, uses)
        assert (uses[0]["token_count"], uses[0]["digest"], uses[0]["discarded"]) == (tokens, cut.digest, None)
    groups = [g for r in dirs.records("metrics.jsonl") for g in r["groups"]]
    assert len(groups) == len(set(groups)) == steps * PROMPTS
    print(f"\nprefix 2x2 -> 2x1: {len(moved)} moved, {len(moved_cut)} of them continued from a cut "
          f"({sum(moved_cut.values())} tokens)")
