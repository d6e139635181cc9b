"""A snapshot overtaken by a trainer checkpoint is kept, and a crash right after it restores from it
(docs/design.md §5.9, issue 34), on a real async run (lookahead 1, the scripted backend, the recording
trainer, the mixed Gym setup, ``checkpointing.keep_top_k=1``), 4 steps.

The instrument ``overtake/sitecustomize.py`` only changes *when* things happen: steps 1 and 2
write their checkpoint slowly (two snapshots begin and end while the step is trained but not
durable), and each then publishes while the next snapshot attempt stands at a chosen point:

- step 1, ``cut``: inside the attempt's pause, before the capture: the capture sees step 1, so the
  snapshot is re-anchored to it (the code before issue 34 dropped it as ``superseded``);
- step 2, ``write``: after resume, before the publish: the capture was of step 1, so it is
  published under ``step_1/``, which the prune (keep_top_k=1) must spare.

The run is SIGKILLed right after step 2's checkpoint was published and the older anchors pruned
(the instrument's kill: the ``checkpointed`` crash point comes before the prune), the overtaken
snapshot the newest on disk; the rerun must restore that snapshot, under the older anchor, and
end with every group trained exactly once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.functional.rl_run import load_crash_matrix
from testkit.run_harness import new_marker, run_env, run_once

pytestmark = [pytest.mark.functional, pytest.mark.timeout(420)]

cm = load_crash_matrix()
INSTRUMENT = Path(__file__).resolve().parent / "overtake"
OVERTAKE_ENV = "NEMO_RL_TEST_ONLY_OVERTAKE"
KILL_ENV = "NEMO_RL_TEST_ONLY_OVERTAKE_KILL"


def _run(spec, index: int, **extra: str):
    env = run_env(marker=new_marker(), pythonpath=[INSTRUMENT], extra=extra)
    return run_once(spec.args(), env=env, stdout_path=spec.root / f"run-{index}.out",
                    stderr_path=spec.root / f"run-{index}.err", timeout_s=240)


def test_overtaken_snapshots_commit_and_a_kill_right_after_one_restores_from_it(tmp_path):
    spec = cm.RunSpec(tmp_path, steps=4, **cm.ASYNC_SHAPE, extra=["checkpointing.keep_top_k=1"])
    first = _run(spec, 1, **{OVERTAKE_ENV: "1:cut,2:write", KILL_ENV: "2"})
    err = first.stderr()
    assert first.returncode == -9 and "TEST-ONLY crash" in err, (first.returncode, first.tail(30))
    assert err.count("overtake instrument: trainer step") == 2, err[-3000:]
    rows = spec.records("snapshots.jsonl")
    # No attempt was dropped; every one begun while a step was trained but not durable committed.
    assert rows and not [r for r in rows if r["reason"] == "superseded"], rows
    ahead = [r for r in rows if r["step"] > r["anchor_step"] or "overtaken_by" in r]
    assert len(ahead) >= 6 and all(r["committed"] for r in ahead), ahead  # per step: 2, then the overtaken one
    cut, written = [r for r in rows if "overtaken_by" in r]
    # cut after step 1's publish: re-anchored to step 1
    assert cut["committed"] and (cut["overtaken_by"], cut["anchor_step"]) == (1, 1), cut
    assert "/step_1/rollout_snapshots/snapshot_" in cut["path"], cut
    # cut before step 2's publish: kept under step 1, the newest snapshot when the run was killed
    assert written["committed"] and (written["overtaken_by"], written["anchor_step"]) == (2, 1), written
    assert "/step_1/rollout_snapshots/snapshot_" in written["path"], written
    assert [r for r in rows if r["committed"]][-1] is written, rows
    assert Path(written["path"]).is_dir()  # step 2's prune (keep_top_k=1) spared step_1

    final = _run(spec, 2)
    assert final.returncode == 0, final.tail(30)
    restore = spec.restore_record()
    assert restore is not None and restore["trainer_step"] == 2, restore
    assert restore["snapshot"] == written["path"] and restore["snapshot_anchor_step"] == 1, restore
    assert cm.check_lineage(spec) == []
    assert cm.check_restore(restore, cm.trained_rollout_ids(spec), final=True) == []
    assert cm.check_version_lag(spec, 1) == []
