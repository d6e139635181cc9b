"""A long real run: what snapshots and trainer checkpoints store does not grow with the steps.

Ledger schema 1 kept a list of every trained group id and wrote it into every
snapshot's ``controller_state.json`` and twice into every trainer state: about
11 bytes per step per copy at one prompt per step. The run here (real
``run_grpo.py`` process, real Ray and Gym, scripted backend, recording trainer)
checkpoints every step and keeps every step, and each size is read from disk.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

from bench import record_sizes  # noqa: E402

pytestmark = [pytest.mark.functional, pytest.mark.timeout(400)]
STEPS = 150  # about 45 s here (2 cores, load 4)
TRAINER_SPREAD_B = 48  # digits of the step, position and counts grow (1 -> 150): a few bytes
SNAPSHOT_SPREAD_B = 96  # plus which phase the rollouts in flight were in at the cut


def test_snapshot_and_trainer_state_sizes_stay_flat_over_a_long_run(tmp_path):
    res = record_sizes.measure(workdir=tmp_path, steps=STEPS, log=print)
    rows = res["rows"]
    print("\n" + record_sizes.table(res, (1, 10, 50, 100, 150)))
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))

    trainer = [r["trainer_state_bytes"] for r in rows]
    assert max(trainer) - min(trainer) <= TRAINER_SPREAD_B, trainer
    assert abs(trainer[-1] - trainer[9]) <= TRAINER_SPREAD_B  # step 10 against the end
    assert abs(res["slopes"]["trainer_state_bytes"]) < 0.5  # schema 1: about +22 B/step here

    snaps = [(r["step"], r["controller_state_bytes"]) for r in rows if r["controller_state_bytes"] is not None]
    sizes = [b for _, b in snaps]
    # A cut while a step trains or checkpoints also holds that step's complete group and its samples (a
    # restore trains it again): a snapshot holds one or two steps' groups, never more, however long the run.
    assert max(sizes) <= 2 * min(sizes) + SNAPSHOT_SPREAD_B, snaps
    one_step = [(s, b) for s, b in snaps if b - min(sizes) <= SNAPSHOT_SPREAD_B]
    assert len(one_step) >= len(snaps) // 2, snaps  # most cuts hold one step's group
    # Early against late, one-step cuts only: which share of a window's cuts met a step training is timing (a
    # window of 10 steps held 3 two-step cuts of 6 on a busy CI machine), the size of a one-step cut is not.
    first = [b for s, b in one_step if s <= STEPS // 3]
    last = [b for s, b in one_step if s > STEPS - STEPS // 3]
    assert first and last, f"no one-step cut in the first or the last third: {snaps}"
    assert abs(statistics.median(last) - statistics.median(first)) <= SNAPSHOT_SPREAD_B / 2, (first, last)
    # The slope over the one-step cuts (a two-step cut is an outlier of one group, not growth).
    slope = statistics.linear_regression([s for s, _ in one_step], [b for _, b in one_step]).slope
    assert abs(slope) < 0.5, (slope, res["slopes"])  # schema 1: about +11 B/step here

    # What the records say is what was trained: one range, no group record, no id list.
    for r in rows:
        assert r["trained_positions"] == [[0, r["step"]]] and r["trained_count"] == r["step"]
        assert r["groups_in_ledger"] == 0  # a trainer checkpoint keeps trained positions only
    final = json.loads((tmp_path / "run" / "ckpt" / f"step_{STEPS}" / "recording_trainer.json").read_text())
    lineage = [g for b in final["batches"] for g in b["groups"]]
    assert lineage == [f"s{t}p{t - 1}" for t in range(1, STEPS + 1)]
    assert "trained_group_ids" not in json.dumps(final["extra_state"])
    newest = sorted((tmp_path / "run" / "ckpt").glob("step_*/rollout_snapshots/snapshot_*/controller_state.json"))
    assert newest and all("trained_group_ids" not in p.read_text() for p in newest)



def test_crash_matrix_checks_the_ledgers_trained_record_against_the_lineage(tmp_path):
    """The crash matrix compares the final ledger's count and ranges with the lineage it trained."""
    import crash_matrix as cm

    spec = cm.RunSpec(tmp_path, steps=2, prompts=2, generations=1)
    step = spec.ckpt / "step_2"
    step.mkdir(parents=True)

    def write(count, ranges):
        batches = [{"groups": groups, "rollout_ids": [f"{g}_g0_a0{i}" for i, g in enumerate(groups)],
                    "rewards": {f"{g}_g0_a0{i}": 1.0 for i, g in enumerate(groups)}}
                   for groups in (["s1p0", "s1p1"], ["s2p2", "s2p3"])]
        ledger = {"trained_count": count, "trained_positions": ranges}
        (step / "recording_trainer.json").write_text(json.dumps({"batches": batches,
                                                                  "extra_state": {"ledger": ledger}}))

    write(4, [[0, 4]])
    assert cm.check_lineage(spec) == []
    write(3, [[0, 3]])  # the ledger lost one the trainer trained
    assert any("does not match the lineage (4 groups, positions [[0, 4]])" in p for p in cm.check_lineage(spec))
    write(4, [[0, 2], [3, 5]])
    assert any("trained record" in p for p in cm.check_lineage(spec))
