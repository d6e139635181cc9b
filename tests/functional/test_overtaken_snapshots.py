"""A snapshot overtaken by a trainer checkpoint is kept, and a crash right after it restores from it
(docs/design.md §5.9, issue 34), on real async runs (lookahead 1, the scripted backend, the recording
trainer, the mixed Gym setup, ``checkpointing.keep_top_k=1``).

The instrument ``overtake/sitecustomize.py`` only changes *when* things happen: steps 1 and 2
write their checkpoint slowly (two snapshots begin and end while the step is trained but not
durable), and each then publishes while the next snapshot attempt stands at a chosen point:

- ``cut``: inside the attempt's pause, before the capture: the capture sees the new step, so the
  snapshot is re-anchored to it (the code before issue 34 dropped it as ``superseded``);
- ``write``: after resume, before the publish: the capture was of the older step, so it is
  published under that anchor, which the prune (keep_top_k=1) must spare.

The run is SIGKILLed right after step 2's checkpoint (``checkpointed:2``: published and pruned,
the overtaken snapshot the newest on disk); the rerun must restore that snapshot and end with
every group trained exactly once.
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


def _run(spec, index: int, *, crash: str | None = None, overtake: str | None = None):
    env = run_env(marker=new_marker(), crash=crash, pythonpath=[INSTRUMENT],
                  extra={OVERTAKE_ENV: overtake} if overtake else None)
    return run_once(spec.args(), env=env, stdout_path=spec.root / f"run-{index}.out",
                    stderr_path=spec.root / f"run-{index}.err", timeout_s=240)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    done: dict[str, tuple] = {}

    def get(where: str):
        if where not in done:
            spec = cm.RunSpec(tmp_path_factory.mktemp(f"overtake-{where}"), steps=4, **cm.ASYNC_SHAPE,
                              extra=["checkpointing.keep_top_k=1"])
            first = _run(spec, 1, crash="checkpointed:2", overtake=f"{where}:1,2")
            killed_rows = spec.records("snapshots.jsonl")
            final = _run(spec, 2)
            done[where] = (spec, first, killed_rows, final, spec.restore_record())
        return done[where]

    return get


@pytest.mark.parametrize("where", ["cut", "write"])
def test_an_overtaken_snapshot_commits_and_a_kill_right_after_it_restores_from_it(runs, where):
    spec, first, rows, final, restore = runs(where)
    err = first.stderr()
    assert first.returncode == -9 and "TEST-ONLY crash" in err, (first.returncode, first.tail(30))
    assert err.count("overtake instrument: trainer step") == 2, err[-3000:]
    # No attempt was dropped; every one begun while a step was trained but not durable committed.
    assert rows and not [r for r in rows if r["reason"] == "superseded"], rows
    ahead = [r for r in rows if r["step"] > r["anchor_step"] or "overtaken_by" in r]
    assert len(ahead) >= 6 and all(r["committed"] for r in ahead), ahead  # 2 + 1 overtaken, per step
    overtaken = [r for r in rows if "overtaken_by" in r]
    assert sorted(r["overtaken_by"] for r in overtaken) == [1, 2], overtaken
    for r in overtaken:
        # cut: the capture saw the new step and went under it; write: it stayed under its own anchor
        expected = r["overtaken_by"] if where == "cut" else r["overtaken_by"] - 1
        assert r["committed"] and r["anchor_step"] == expected, r
        anchor = "bootstrap" if expected == 0 else f"step_{expected}"
        assert f"/{anchor}/rollout_snapshots/snapshot_" in r["path"], r
    newest = [r for r in rows if r.get("committed")][-1]
    assert newest["overtaken_by"] == 2, (newest, rows)  # the kill came right after it
    # The rerun restores exactly that snapshot with trainer step 2; every group trained once.
    assert final.returncode == 0, final.tail(30)
    assert restore is not None and restore["trainer_step"] == 2, restore
    assert restore["snapshot"] == newest["path"], (restore, newest)
    assert restore["snapshot_anchor_step"] == newest["anchor_step"], restore
    assert cm.check_lineage(spec) == []
    assert cm.check_restore(restore, cm.trained_rollout_ids(spec), final=True) == []
    assert cm.check_version_lag(spec, 1) == []
