"""Atomic snapshot layout: publish, prune, and skip torn or corrupt snapshots."""

from __future__ import annotations

import json
import os

import pytest

from nemo_rl.utils.atomic_write import write_json_atomic
from nemo_rl.utils.snapshot_store import (
    MANIFEST_NAME,
    SnapshotStoreError,
    anchor_dir,
    commit_snapshot,
    ensure_bootstrap_anchor,
    list_trainer_steps,
    next_snapshot_name,
    prepare_snapshot_paths,
    prepare_trainer_step,
    prune_trainer_steps,
    publish_trainer_step,
    remove_stale_tmp_dirs,
    resolve_latest_snapshot,
    resolve_restore_point,
    sha256_file,
    verify_directory,
)


def _publish(anchor, payload, keep=5, name=None):
    tmp, final = prepare_snapshot_paths(anchor, name)
    write_json_atomic(tmp / "state.json", payload)
    (tmp / "gym" / "model").mkdir(parents=True)
    (tmp / "gym" / "model" / "records.jsonl").write_text(json.dumps(payload) + "\n")
    commit_snapshot(tmp, final, keep, metadata={"payload": payload})
    return final


def _names(anchor):
    return sorted(p.name for p in (anchor / "rollout_snapshots").iterdir())


def test_write_json_atomic_and_sha(tmp_path):
    path = tmp_path / "a" / "x.json"
    write_json_atomic(path, {"b": 1})
    write_json_atomic(path, {"b": 2})
    assert json.loads(path.read_text()) == {"b": 2}
    assert os.listdir(path.parent) == ["x.json"]  # no temp file left
    import hashlib

    assert sha256_file(path) == hashlib.sha256(path.read_bytes()).hexdigest()


def test_paths_layout_and_sequence(tmp_path):
    tmp, final = prepare_snapshot_paths(tmp_path, "000007-rollout-ab12")
    assert final == tmp_path / "rollout_snapshots" / "snapshot_000007-rollout-ab12"
    assert tmp == tmp_path / "rollout_snapshots" / ".tmp-snapshot_000007-rollout-ab12"
    assert tmp.is_dir() and not final.exists()
    # a tmp dir already counts, so a later name never reuses its sequence
    assert next_snapshot_name(tmp_path) == "000008"
    with pytest.raises(SnapshotStoreError, match="snapshot_name"):
        prepare_snapshot_paths(tmp_path, "../evil")


def test_commit_writes_manifest_last_and_renames(tmp_path):
    final = _publish(tmp_path, {"n": 1})
    manifest = json.loads((final / MANIFEST_NAME).read_text())
    assert set(manifest["files"]) == {"state.json", "gym/model/records.jsonl"}
    for rel, entry in manifest["files"].items():
        assert entry["sha256"] == sha256_file(final / rel)
        assert entry["size"] == (final / rel).stat().st_size
    assert manifest["sequence"] == 1 and manifest["metadata"] == {"payload": {"n": 1}}
    assert _names(tmp_path) == ["snapshot_000001"]
    sel = resolve_latest_snapshot(tmp_path)
    assert sel.path == final and sel.skipped == [] and sel.manifest.sequence == 1


def test_commit_refuses_existing_final(tmp_path):
    final = _publish(tmp_path, {"n": 1}, name="000001")
    with pytest.raises(SnapshotStoreError, match="already exists"):
        prepare_snapshot_paths(tmp_path, "000001")
    tmp = final.parent / ".tmp-snapshot_000001"
    tmp.mkdir()
    with pytest.raises(SnapshotStoreError, match="already exists"):
        commit_snapshot(tmp, final, 2)


def test_latest_is_by_sequence_not_mtime(tmp_path):
    first = _publish(tmp_path, {"n": 1})
    second = _publish(tmp_path, {"n": 2})
    os.utime(first, (4e9, 4e9))  # first looks newer by mtime
    assert resolve_latest_snapshot(tmp_path).path == second
    # Numeric order, not lexical: 10 > 9.
    _publish(tmp_path, {"n": 9}, name="9")
    ten = _publish(tmp_path, {"n": 10}, name="10")
    assert resolve_latest_snapshot(tmp_path).path == ten


def test_prune_keeps_latest_k_and_removes_stale_tmp(tmp_path):
    for i in range(4):
        _publish(tmp_path, {"n": i}, keep=2)
    assert _names(tmp_path) == ["snapshot_000003", "snapshot_000004"]
    stale = tmp_path / "rollout_snapshots" / ".tmp-snapshot_000099"
    stale.mkdir()
    (stale / "half.json").write_text("{")
    _publish(tmp_path, {"n": 5}, keep=1, name="000100")
    assert _names(tmp_path) == ["snapshot_000100"]


def test_prune_does_not_count_corrupt_snapshots(tmp_path):
    _publish(tmp_path, {"n": 1}, keep=2)
    bad = _publish(tmp_path, {"n": 2}, keep=2)
    (bad / "state.json").write_text("garbage")
    newest = _publish(tmp_path, {"n": 3}, keep=2)
    # the corrupt one is dropped; the valid older one is kept as the second of k=2
    assert _names(tmp_path) == ["snapshot_000001", newest.name]


def _corrupt_cases():
    def truncated_manifest(d):
        raw = (d / MANIFEST_NAME).read_bytes()
        (d / MANIFEST_NAME).write_bytes(raw[: len(raw) // 2])
        return MANIFEST_NAME

    def flipped_byte(d):
        path = d / "gym" / "model" / "records.jsonl"
        raw = bytearray(path.read_bytes())
        raw[3] ^= 0x20
        path.write_bytes(bytes(raw))
        return "records.jsonl"

    def missing_file(d):
        (d / "state.json").unlink()
        return "state.json"

    def missing_manifest(d):
        (d / MANIFEST_NAME).unlink()
        return MANIFEST_NAME

    def truncated_file(d):
        path = d / "state.json"
        path.write_bytes(path.read_bytes()[:-2])
        return "state.json"

    return [truncated_manifest, flipped_byte, missing_file, missing_manifest, truncated_file]


@pytest.mark.parametrize("corrupt", _corrupt_cases(), ids=lambda f: f.__name__)
def test_corrupt_newest_snapshot_is_skipped_and_named(tmp_path, corrupt):
    good = _publish(tmp_path, {"n": 1})
    bad = _publish(tmp_path, {"n": 2})
    bad_file = corrupt(bad)
    sel = resolve_latest_snapshot(tmp_path)
    assert sel.path == good
    (skipped_path, reason), = sel.skipped
    assert skipped_path == bad
    assert bad_file in reason and str(bad) in reason
    with pytest.raises(SnapshotStoreError, match=bad_file):
        verify_directory(bad)


def test_half_written_tmp_dir_is_skipped_and_named(tmp_path):
    good = _publish(tmp_path, {"n": 1})
    tmp, _final = prepare_snapshot_paths(tmp_path)  # crash before commit
    (tmp / "state.json").write_text('{"n": 2')
    sel = resolve_latest_snapshot(tmp_path)
    assert sel.path == good
    assert [(p, "unpublished" in r) for p, r in sel.skipped] == [(tmp, True)]


def test_no_valid_snapshot_gives_none_with_reasons(tmp_path):
    assert resolve_latest_snapshot(tmp_path) == (None, [], None)
    bad = _publish(tmp_path, {"n": 1})
    (bad / "state.json").unlink()
    sel = resolve_latest_snapshot(tmp_path)
    assert sel.path is None and len(sel.skipped) == 1


def test_renamed_snapshot_with_wrong_sequence_is_skipped(tmp_path):
    snap = _publish(tmp_path, {"n": 1})
    moved = snap.parent / "snapshot_000005"
    snap.rename(moved)
    sel = resolve_latest_snapshot(tmp_path)
    assert sel.path is None and "sequence 1" in sel.skipped[0][1]


# ----- trainer anchors ------------------------------------------------------
def _trainer_step(ckpt, step, weights=b"w"):
    tmp, final = prepare_trainer_step(ckpt, step)
    (tmp / "weights.pt").write_bytes(weights)
    write_json_atomic(tmp / "trainer_state.json", {"step": step})
    publish_trainer_step(tmp, final, metadata={"step": step})
    return final


def test_anchor_dirs(tmp_path):
    assert anchor_dir(tmp_path, 0) == tmp_path / "bootstrap"
    assert anchor_dir(tmp_path, 3) == tmp_path / "step_3"


def test_trainer_steps_listed_only_when_valid(tmp_path):
    assert list_trainer_steps(tmp_path / "none") == []
    ensure_bootstrap_anchor(tmp_path, {"fingerprint": "abc"})
    assert ensure_bootstrap_anchor(tmp_path) == tmp_path / "bootstrap"  # idempotent
    _trainer_step(tmp_path, 1)
    s2 = _trainer_step(tmp_path, 2)
    _trainer_step(tmp_path, 10)
    assert list_trainer_steps(tmp_path) == [0, 1, 2, 10]
    (s2 / "weights.pt").write_bytes(b"xx")  # torn after publish: another size than the manifest says
    (tmp_path / "step_11").mkdir()  # no manifest
    tmp, _ = prepare_trainer_step(tmp_path, 12)  # never published
    (tmp / "weights.pt").write_bytes(b"half")
    assert list_trainer_steps(tmp_path) == [0, 1, 10]


def test_snapshots_under_a_step_do_not_break_its_manifest(tmp_path):
    step = _trainer_step(tmp_path, 1)
    snap = _publish(step, {"n": 1})
    assert list_trainer_steps(tmp_path) == [1]
    point = resolve_restore_point(tmp_path)
    assert point.step == 1 and point.anchor == step and point.snapshot.path == snap


def test_restore_point_falls_back_past_a_torn_step(tmp_path):
    ensure_bootstrap_anchor(tmp_path)
    boot_snap = _publish(tmp_path / "bootstrap", {"n": 0})
    step = _trainer_step(tmp_path, 1)
    (step / "weights.pt").unlink()
    point = resolve_restore_point(tmp_path)
    assert point.step == 0 and point.snapshot.path == boot_snap
    assert resolve_restore_point(tmp_path / "empty") is None


def test_publish_replaces_torn_step_but_not_a_valid_one(tmp_path):
    step = _trainer_step(tmp_path, 1)
    with pytest.raises(SnapshotStoreError, match="valid trainer step already exists"):
        _trainer_step(tmp_path, 1)
    (step / MANIFEST_NAME).unlink()
    _trainer_step(tmp_path, 1, weights=b"new")
    assert (step / "weights.pt").read_bytes() == b"new"
    assert list_trainer_steps(tmp_path) == [1]
    with pytest.raises(SnapshotStoreError, match="start at 1"):
        prepare_trainer_step(tmp_path, 0)


def test_remove_stale_tmp_dirs(tmp_path):
    ensure_bootstrap_anchor(tmp_path)
    step = _trainer_step(tmp_path, 1)
    t1, _ = prepare_trainer_step(tmp_path, 2)
    t2, _ = prepare_snapshot_paths(step)
    t3, _ = prepare_snapshot_paths(tmp_path / "bootstrap")
    removed = remove_stale_tmp_dirs(tmp_path)
    assert sorted(removed) == sorted([t1, t2, t3])
    assert not any(p.exists() for p in (t1, t2, t3))
    assert list_trainer_steps(tmp_path) == [0, 1]


def test_bootstrap_stays_until_keep_top_k_steps_exist(tmp_path):
    """Its snapshots may restore with step 1 (a crash right after step 1's checkpoint)."""
    ensure_bootstrap_anchor(tmp_path)
    _trainer_step(tmp_path, 1)
    assert prune_trainer_steps(tmp_path, 2, 1) == []
    assert list_trainer_steps(tmp_path) == [0, 1]
    _trainer_step(tmp_path, 2)
    assert [p.name for p in prune_trainer_steps(tmp_path, 2, 2)] == ["bootstrap"]
    assert list_trainer_steps(tmp_path) == [1, 2]


def test_prune_spares_the_anchor_of_the_newest_snapshot(tmp_path):
    ensure_bootstrap_anchor(tmp_path)
    for step in (1, 2, 3):
        _trainer_step(tmp_path, step)
    assert sorted(p.name for p in prune_trainer_steps(tmp_path, 1, 3, spare={1})) == ["bootstrap", "step_2"]
    assert list_trainer_steps(tmp_path) == [1, 3]
    assert [p.name for p in prune_trainer_steps(tmp_path, 1, 3)] == ["step_1"]  # a newer snapshot: it goes


def test_prune_trainer_steps_keeps_the_newest_k_with_their_snapshots(tmp_path):
    ensure_bootstrap_anchor(tmp_path)
    for step in (1, 2, 3, 4):
        _trainer_step(tmp_path, step)
    tmp, final = prepare_snapshot_paths(anchor_dir(tmp_path, 4))
    (tmp / "x.json").write_text("{}")
    commit_snapshot(tmp, final, 2)
    assert prune_trainer_steps(tmp_path, None) == []  # null keeps everything
    removed = prune_trainer_steps(tmp_path, 2)
    assert sorted(p.name for p in removed) == ["bootstrap", "step_1", "step_2"]
    assert list_trainer_steps(tmp_path) == [3, 4]
    assert resolve_latest_snapshot(anchor_dir(tmp_path, 4)).path == final  # the kept step keeps its snapshots
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3", "step_4"]  # no trash left
    with pytest.raises(SnapshotStoreError, match="keep_top_k"):
        prune_trainer_steps(tmp_path, 0)
