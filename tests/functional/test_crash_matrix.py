"""The crash matrix's CI subset, and torn/corrupt snapshots, on real crashed runs.

``examples/crash_matrix.py`` runs every phase plus a random soak. Here one run
is SIGKILLed by the test-only hook while publishing the third snapshot of a
step (``publish:3``: two valid snapshots and a written-but-unsealed one on
disk); copies of its checkpoint directory then serve three tests:

- the crash chain: the next run is killed after Gym restored a snapshot and
  before the ledger is applied (``restore``), the one after that has only its
  driver SIGKILLed between snapshots (no hook), and the same command then runs
  to the end. The final trainer checkpoint's lineage must hold every prompt
  group exactly once, no sample lost or duplicated; what each rerun continued
  at turn level (``-a<N>`` ids) or restarted from the prompt must be in it; no
  process of a killed run may outlive it;
- corrupt snapshots (a truncated manifest, a flipped byte in a Gym records file,
  a seal without ``gym_checkpoint.json``, a directory without a manifest, the
  unsealed one): restore skips each by name and uses the newest valid one;
- none valid: the run resumes from the trainer anchor and says so.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

pytestmark = [pytest.mark.functional, pytest.mark.timeout(150)]

REPO = Path(__file__).resolve().parents[2]

from tests.functional.rl_run import load_crash_matrix  # noqa: E402

cm = load_crash_matrix()
SPEC = dict(steps=2, interval_s=0.25, delay_s=0.4, keep_latest_k=5)


@pytest.fixture(scope="module")
def publish_crash(tmp_path_factory) -> "cm.RunSpec":
    """A run SIGKILLed (whole process group) while publishing the 3rd snapshot of a step."""
    spec = cm.RunSpec(tmp_path_factory.mktemp("publish-crash"), **SPEC)
    result = cm.Runner(spec, log=lambda _: None).run(crash="publish:3")
    assert result.crashed_by_hook, (result.returncode, result.stderr[-2000:])
    assert result.leftover == [] and result.cleanup_s < cm.ORPHAN_GRACE_S, "processes of the killed run outlived it"
    return spec


def _copy(src: "cm.RunSpec", root: Path) -> "cm.RunSpec":
    shutil.copytree(src.root, root, dirs_exist_ok=True)
    return cm.RunSpec(root, **SPEC)


def _layout(spec: "cm.RunSpec") -> tuple[Path, list[Path], Path]:
    """(anchor, published snapshots oldest first, the unsealed tmp dir) of the crashed step."""
    torn = sorted(spec.ckpt.glob("*/rollout_snapshots/.tmp-snapshot_*"))
    assert len(torn) == 1, torn
    root = torn[0].parent
    published = sorted(p for p in root.iterdir() if p.name.startswith("snapshot_"))
    assert len(published) == 2, published
    return root.parent, published, torn[0]


# ------------------------------------------------------------------------------ the crash chain
def test_publish_then_restore_then_driver_kill_then_finish(publish_crash, tmp_path):
    spec = _copy(publish_crash, tmp_path)
    _, (_, newest_valid), torn = _layout(spec)
    assert (torn / "controller_state.json").is_file() and (torn / "gym_checkpoint.json").is_file()
    assert not (torn / "manifest.json").exists()  # written, never sealed
    runner = cm.Runner(spec, log=lambda _: None)

    # crash after Gym restored the newest valid snapshot, before the ledger is applied
    second = runner.run(crash="restore")
    assert second.crashed_by_hook, (second.returncode, second.stderr[-2000:])
    assert second.leftover == [] and second.cleanup_s < cm.ORPHAN_GRACE_S
    assert second.restore is None  # killed before it could record a restore
    assert f"removed a half-written checkpoint directory left by a crash: {torn}" in second.stderr
    assert not torn.exists()

    # restore again (fresh Gym processes), get past step 1, then SIGKILL the driver only, no hook
    third = runner.run(kill_when=cm.committed_in_step(spec, 1), kill_driver_only=True)
    assert third.killed_by == "driver", (third.returncode, third.stderr[-2000:])
    assert third.leftover == [] and third.cleanup_s < cm.ORPHAN_GRACE_S, (third.leftover, third.cleanup_s)
    r3 = third.restore
    assert r3 is not None and r3["snapshot"] == str(newest_valid), r3
    assert r3["restored_turn"] > 0 and r3["restarted_from_prompt"] > 0, r3
    assert all(k.endswith("-a1") for k in r3["restored_rollout_ids"]), r3

    # the same command again, to the end
    final = runner.run()
    assert final.returncode == 0, final.stderr[-3000:]
    assert final.leftover == []
    r4 = final.restore
    assert r4 is not None and r4["trainer_step"] == 1 and r4["snapshot"] is not None, r4
    assert r4["restored_turn"] > 0, r4

    assert cm.check_lineage(spec) == []
    trained = cm.trained_rollout_ids(spec)
    assert cm.check_restore(r4, trained, final=True) == []
    # run 3 trained step 1 and checkpointed it, so what it continued or restarted is in the lineage too
    assert set(r3["restored_rollout_ids"]) <= trained
    assert set(r3["restarted_rollout_ids"]) <= trained
    batches = json.loads((spec.ckpt / "step_2" / "recording_trainer.json").read_text())["batches"]
    assert [b["weight_version"] for b in batches] == [1, 2]


# ------------------------------------------------------------------------------ torn and corrupt
def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _reseal_without(snapshot: Path, name: str, sequence: int) -> None:
    """Delete ``name`` and rewrite the manifest so it no longer lists it (a consistent but incomplete seal)."""
    (snapshot / name).unlink()
    manifest = json.loads((snapshot / "manifest.json").read_text())
    del manifest["files"][name]
    manifest["sequence"] = sequence
    (snapshot / "manifest.json").write_text(json.dumps(manifest))


def test_corrupt_snapshots_are_skipped_by_name_and_the_newest_valid_one_restores(publish_crash, tmp_path):
    spec = _copy(publish_crash, tmp_path)
    _, (s1, s2), torn = _layout(spec)
    root = s1.parent
    # newest first: a seal without gym_checkpoint.json, a truncated manifest, no manifest, a flipped byte, valid
    incomplete = root / "snapshot_000009"
    shutil.copytree(s2, incomplete)
    _reseal_without(incomplete, "gym_checkpoint.json", 9)
    truncated = root / "snapshot_000008"
    shutil.copytree(s2, truncated)
    text = (truncated / "manifest.json").read_text()
    (truncated / "manifest.json").write_text(text[: len(text) // 2])
    half = root / "snapshot_000007"
    shutil.copytree(s1, half)
    (half / "manifest.json").unlink()
    records = sorted(s2.glob("gym-instances/*/replica-0/gym/agent/workplace_simple_agent/records-*.jsonl"))
    assert len(records) == 1
    _flip_byte(records[0])
    saved_in_s1 = sum(len(v) for v in json.loads((s1 / "gym_checkpoint.json").read_text())["turn_level"].values())
    assert saved_in_s1 > 0

    final = cm.Runner(spec, log=lambda _: None).run()
    assert final.returncode == 0, final.stderr[-3000:]
    restore = final.restore
    assert restore["snapshot"] == str(s1), restore
    assert restore["restored_turn"] == saved_in_s1
    reasons = {Path(s["path"]).name: s["reason"] for s in restore["skipped_snapshots"]}
    expected = {
        incomplete.name: f"{incomplete / 'gym_checkpoint.json'}: missing (not listed in",
        truncated.name: f"{truncated / 'manifest.json'}: unreadable manifest",
        half.name: f"{half / 'manifest.json'}: missing",
        s2.name: f"{records[0]}: sha256 does not match the manifest",
    }
    assert set(reasons) == set(expected), reasons
    for name, text in expected.items():
        assert text in reasons[name], (name, reasons[name])
        assert f"skipping rollout snapshot {root / name}: {reasons[name]}" in final.stderr
    assert f"removed a half-written checkpoint directory left by a crash: {torn}" in final.stderr
    assert cm.check_lineage(spec) == []
    assert cm.check_restore(restore, cm.trained_rollout_ids(spec), final=True) == []


def test_no_valid_snapshot_resumes_from_the_trainer_checkpoint_and_says_so(publish_crash, tmp_path, capsys, caplog):
    """Every snapshot bad: restore uses the trainer anchor alone (in-process controller; no Gym is called)."""
    from nemo_rl.algorithms.recording_trainer import RecordingTrainer
    from nemo_rl.algorithms.single_controller import SingleController
    from nemo_rl.algorithms.single_controller_utils.config import load_config
    from nemo_rl.data.dataloader import load_jsonl
    from gym_patches.checkpoint.storage import FileSystemWriter
    from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.store import RunStore
    from nemo_rl.environments.nemo_gym import NemoGymShardSet

    spec = _copy(publish_crash, tmp_path)
    anchor, (s1, s2), torn = _layout(spec)
    (s2 / "gym_checkpoint.json").unlink()  # listed in its manifest, gone
    (s1 / "controller_state.json").write_text("{}")  # another size than the manifest says
    config = load_config(REPO / "examples/configs/grpo_mixed_turn.yaml", spec.args()[2:])
    store = RunStore(config.checkpointing.checkpoint_dir, FileSystemWriter(),
                     keep_latest_k=config.rollout_checkpointing.keep_latest_k)
    controller = SingleController(config, NemoGymShardSet(handles={}, instances={}), RecordingTrainer(spec.logs),
                                  None, load_jsonl(REPO / config.data.train_data_path), store=store)
    with caplog.at_level("WARNING"):
        asyncio.run(controller.restore_if_any())
    step = 0 if anchor.name == "bootstrap" else int(anchor.name.removeprefix("step_"))
    assert f"Resuming from trainer checkpoint step {step} (no valid rollout snapshot)." in capsys.readouterr().out
    restore = json.loads((spec.logs / "restore.json").read_text())
    assert restore["snapshot"] is None and restore["trainer_step"] == step
    reasons = {Path(s["path"]).name: s["reason"] for s in restore["skipped_snapshots"]}
    assert reasons[s2.name] == f"{s2 / 'gym_checkpoint.json'}: listed in the manifest but missing"
    assert reasons[s1.name].startswith(f"{s1 / 'controller_state.json'}: size 2, manifest says")
    logged = caplog.text
    assert str(s2 / "gym_checkpoint.json") in logged and str(s1 / "controller_state.json") in logged
    assert str(torn) in logged  # the unsealed tmp dir was removed, and named
    assert controller.step == step


# ------------------------------------------------------------------------------ the checker can fail
def test_lineage_check_catches_duplicates_and_losses(tmp_path):
    """A duplicated group, a lost sample, a changed reward, a continued rollout not trained."""
    spec = cm.RunSpec(tmp_path, steps=2, prompts=2, generations=2)
    step = spec.ckpt / "step_2"
    step.mkdir(parents=True)

    def batch(groups, drop=(), reward=1.0):
        ids = [f"{g}_g{i}_a{n:02x}" for n, g in enumerate(groups) for i in range(2)]
        ids = [r for r in ids if r not in drop]
        return {"groups": groups, "rollout_ids": sorted(ids), "rewards": {r: reward for r in ids}}

    def write(batches):
        (step / "recording_trainer.json").write_text(json.dumps({"batches": batches}))

    write([batch(["s1p0", "s1p1"]), batch(["s2p2", "s2p3"])])
    assert cm.check_lineage(spec) == []
    write([batch(["s1p0", "s1p1"]), batch(["s2p2", "s1p1"])])
    assert any("more than once" in p for p in cm.check_lineage(spec))
    write([batch(["s1p0", "s1p1"]), batch(["s2p2", "s2p3"], drop=("s2p3_g1_a01",))])
    assert any("generations [0]" in p for p in cm.check_lineage(spec))
    write([batch(["s1p0", "s1p1"]), batch(["s2p2", "s2p3"], reward=0.0)])
    assert cm.check_lineage(spec) == []  # a row the backend cannot solve: every sibling agrees
    lone = batch(["s2p2", "s2p3"])
    lone["rewards"]["s2p3_g1_a01"] = 0.0
    write([batch(["s1p0", "s1p1"]), lone])
    assert any("siblings with different rewards" in p for p in cm.check_lineage(spec))
    write([batch(["s1p0", "s1p1"]), batch(["s2p2", "s2p3"], reward=0.0)])
    reference = {(g, i): 1.0 for g in ("s1p0", "s1p1", "s2p2", "s2p3") for i in range(2)}
    assert any("differ from the crash-free run" in p for p in cm.check_lineage(spec, reference))
    reference.update({("s2p2", i): 0.0 for i in range(2)} | {("s2p3", i): 0.0 for i in range(2)})
    assert cm.check_lineage(spec, reference) == []
    assert cm.check_restore({"snapshot": "x", "restored_turn": 1, "restored_rollout_ids": ["s9p9_g0_aff-a1"],
                             "restarted_rollout_ids": [], "kept_rollout_ids": []}, set(), final=True)


def test_a_kill_between_resume_and_publish_leaves_the_previous_snapshot_newest(tmp_path):
    """Staged commit: SIGKILL after Gym resumed but before it persisted and the snapshot was published
    (``persist:2``). The first snapshot of that step is the newest valid one; the rerun restores it and
    finishes with every group trained exactly once."""
    row = cm.scenario("persist", tmp_path / "persist", log=lambda _: None, **SPEC)
    assert row.problems == [], row.problems
    spec = cm.RunSpec(tmp_path / "persist", **SPEC)
    restore = json.loads((spec.logs / "restore.json").read_text())
    assert restore["snapshot"] is not None and restore["snapshot"].endswith("snapshot_000001")
