"""Crash matrix: SIGKILL a GRPO run at each recovery phase, run the same command again, check the lineage.

    python examples/crash_matrix.py                      # every phase, then a soak of 20 random crashes
    python examples/crash_matrix.py --phases commit,train --soak 0
    python examples/crash_matrix.py --soak 20 --seed 7 --phases ""

Each scenario runs GRPO as a real process (``python -m testkit.run_grpo``: the
product's ``run_grpo`` with the test hooks; the mixed Gym setup in best effort,
the scripted fake backend, the recording trainer) in its own session, crashes
it, then runs the same command again without the crash until it finishes. Runs
are started, killed and reaped through the run harness the tests and the
benchmarks share (``testkit/run_harness.py``). Then it checks what the final
trainer checkpoint trained:

- every prompt group exactly once, every expected group present (no prompt lost);
- every group with one rollout per generation, no rollout id twice (no sample
  lost or duplicated), and every sample's reward equal to what a crash-free
  run of the same command got (the scripted backend is deterministic, so a
  rollout continued from a wrong boundary shows up as a changed reward);
- the rollouts the rerun continued at turn level (``-a<N>`` ids in
  ``restore.json``) and the ones it restarted from the prompt are in the lineage;
- no process of a killed run is left (they die with it; checked via an
  environment marker), so none holds a port.

Phases (``NEMO_RL_TEST_ONLY_CRASH_AT``, see ``testkit/crash_points.py``):
prepare, commit, publish, restore (a crash while restoring the snapshot of an
earlier crash), train; plus ``between`` (a plain SIGKILL of the process group
while snapshots are being taken, no hook) and ``driver`` (SIGKILL of the driver
process only). The soak kills the same run ``--soak`` times at seeded random
times (some during start-up or restore), then lets it finish.

Prints progress lines and a markdown table: phase, outcome, restored_turn,
restarted_from_prompt, kept, verdict. Exit code 0 iff every verdict is ok.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from nemo_rl.utils.run_hooks import PHASES  # noqa: E402
from testkit.run_harness import (  # noqa: E402
    CRASH_ENV,  # noqa: F401 - the hook's variable, for readers of this module
    MARKER_ENV,  # noqa: F401
    REPO,  # noqa: F401
    RunDirs,
    after_committed_in_step,
    after_committed_snapshots,
    new_marker,
    processes_with_marker,  # noqa: F401 - re-exported for the tests
    run_env,
    run_once,
    scripted_overrides,
    wait_for_no_processes,  # noqa: F401 - re-exported for the tests
)

HOOK_PHASES = tuple(PHASES)  # prepare, commit, persist, publish, restore, train
ALL_PHASES = (*HOOK_PHASES, "between", "driver")
_ROLLOUT_ID = re.compile(r"^(?P<group>.+)_g(?P<g>[0-9]+)_a[0-9a-f]+(?:-a(?P<attempt>[0-9]+))?$")


# ----------------------------------------------------------------------------- a run
@dataclass
class RunSpec(RunDirs):
    """One run's command line; the same command is used again after each crash (where it writes: RunDirs)."""

    steps: int = 3
    prompts: int = 4
    generations: int = 4
    interval_s: float = 0.4
    delay_s: float = 0.3
    keep_latest_k: int = 2
    extra: list[str] = field(default_factory=list)

    def args(self) -> list[str]:
        return [
            "--config", "examples/configs/grpo_mixed_turn.yaml",
            "policy.model_name=scripted-test-backend",
            "rollout_recovery.allow_restart_only_gym_servers=true",
            *self.overrides(), "logger.plot=false", *scripted_overrides(self.delay_s),
            f"grpo.max_num_steps={self.steps}",
            f"grpo.num_prompts_per_step={self.prompts}",
            f"grpo.num_generations_per_prompt={self.generations}",
            f"rollout_checkpointing.snapshot_attempt_interval_s={self.interval_s}",
            f"rollout_checkpointing.keep_latest_k={self.keep_latest_k}",
            *self.extra,
        ]


@dataclass
class RunResult:
    index: int
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float
    leftover: list[int]  # processes of this run still alive 30 s after it died (then killed here)
    restore: dict[str, Any] | None  # restore.json this run wrote (None: it wrote none)
    killed_by: str | None = None  # "hook", "group", "driver" or None
    cleanup_s: float = 0.0  # from the run's end until none of its processes was left

    @property
    def crashed_by_hook(self) -> bool:
        return self.returncode == -signal.SIGKILL and "TEST-ONLY crash" in self.stderr


class Runner:
    """Starts the same command again and again; every run gets its own marker and output files."""

    def __init__(self, spec: RunSpec, log: Callable[[str], None] = print):
        self.spec = spec
        self.log = log
        self.count = 0
        self.results: list[RunResult] = []

    def run(
        self,
        *,
        crash: str | None = None,
        kill_when: Callable[[float], bool] | None = None,
        kill_driver_only: bool = False,
        timeout_s: float = 240.0,
    ) -> RunResult:
        """Run once. ``crash``: the hook spec; ``kill_when(elapsed_s)``: SIGKILL from here once it holds."""
        self.count += 1
        index = self.count
        dirs = RunDirs(self.spec.root)
        self.spec.root.mkdir(parents=True, exist_ok=True)
        before = dirs.restore_mtime_ns()
        outcome = run_once(
            self.spec.args(), env=run_env(marker=new_marker(), crash=crash),
            stdout_path=self.spec.root / f"run-{index}.out", stderr_path=self.spec.root / f"run-{index}.err",
            kill_when=kill_when, kill_driver_only=kill_driver_only, timeout_s=timeout_s,
        )
        after = dirs.restore_mtime_ns()
        restore = dirs.restore_record() if after is not None and after != before else None
        killed_by = outcome.killed_by or ("hook" if crash else None)
        result = RunResult(index, outcome.returncode, outcome.stdout(), outcome.stderr(), outcome.wall_s,
                           outcome.leftover, restore, killed_by, outcome.cleanup_s)
        self.results.append(result)
        return result


# ----------------------------------------------------------------------------- checks
def expected_groups(spec: RunSpec) -> list[str]:
    return [f"s{t}p{pos}" for t in range(1, spec.steps + 1)
            for pos in range((t - 1) * spec.prompts, t * spec.prompts)]


def final_lineage(spec: RunSpec) -> list[dict[str, Any]]:
    """The batches the final trainer checkpoint trained (its lineage; rolled-back steps are not in it)."""
    path = spec.ckpt / f"step_{spec.steps}" / "recording_trainer.json"
    return json.loads(path.read_text())["batches"]


def final_trained_record(spec: RunSpec) -> dict[str, Any] | None:
    """What the final trainer checkpoint's ledger says was trained (``trained_count``,
    ``trained_positions``); None when the file holds no controller state (a hand-made lineage)."""
    path = spec.ckpt / f"step_{spec.steps}" / "recording_trainer.json"
    ledger = (json.loads(path.read_text()).get("extra_state") or {}).get("ledger")
    if ledger is None:
        return None
    return {"count": ledger["trained_count"], "ranges": ledger["trained_positions"]}


def lineage_rewards(spec: RunSpec) -> dict[tuple[str, int], float]:
    """Reward of every trained sample by (group, generation): what a crash must not change."""
    out = {}
    for batch in final_lineage(spec):
        for rollout, reward in batch["rewards"].items():
            m = _ROLLOUT_ID.match(rollout)
            if m is not None:
                out[(m["group"], int(m["g"]))] = reward
    return out


def reference_rewards(root: Path, log: Callable[[str], None] = print, **spec_kw: Any) -> dict[tuple[str, int], float]:
    """Run the same command once without any crash; its rewards are what every crashed run must reproduce.

    The scripted backend is deterministic, but not every row reaches reward 1.0
    with it (two rows with the same user text and different setups share one
    plan), so "the reward a crash-free run gets" is the reference, not 1.0.
    """
    spec = RunSpec(root, **spec_kw)
    log(f"[reference] crash-free run, {spec.steps} steps")
    result = Runner(spec, log).run()
    if result.returncode != 0:
        raise RuntimeError(f"the crash-free reference run failed ({result.returncode}): {result.stderr[-2000:]}")
    return lineage_rewards(spec)


def check_lineage(spec: RunSpec, reference: dict[tuple[str, int], float] | None = None) -> list[str]:
    """Every problem with the final lineage (empty: each group trained once, no sample lost or duplicated).

    ``reference``: rewards of a crash-free run of the same command. Without
    one, the siblings of each group must agree: the scripted backend plays a
    row the same way every time, so a rollout continued from a wrong boundary
    stands out against its siblings.
    """
    try:
        batches = final_lineage(spec)
    except (OSError, ValueError, KeyError) as exc:
        return [f"no final trainer checkpoint step_{spec.steps}: {exc}"]
    problems = []
    if len(batches) != spec.steps:
        problems.append(f"{len(batches)} batches in the lineage, expected {spec.steps}")
    groups = [g for b in batches for g in b["groups"]]
    dupes = sorted({g for g in groups if groups.count(g) > 1})
    if dupes:
        problems.append(f"groups trained more than once: {dupes}")
    missing = sorted(set(expected_groups(spec)) - set(groups))
    extra = sorted(set(groups) - set(expected_groups(spec)))
    if missing or extra:
        problems.append(f"groups missing {missing} / unexpected {extra}")
    record = final_trained_record(spec)
    positions = [[0, spec.steps * spec.prompts]]  # the dataloader handed out 0.. in order, each trained once
    if record is not None and (record["count"] != len(groups) or record["ranges"] != positions):
        problems.append(f"the ledger's trained record {record} does not match the lineage "
                        f"({len(groups)} groups, positions {positions})")
    rollouts = [r for b in batches for r in b["rollout_ids"]]
    if len(rollouts) != len(set(rollouts)):
        problems.append("a rollout id was trained twice")
    if len(rollouts) != spec.steps * spec.prompts * spec.generations:
        problems.append(f"{len(rollouts)} samples, expected {spec.steps * spec.prompts * spec.generations}")
    per_group: dict[str, list[int]] = {}
    for r in rollouts:
        m = _ROLLOUT_ID.match(r)
        if m is None:
            problems.append(f"malformed rollout id {r!r}")
            continue
        per_group.setdefault(m["group"], []).append(int(m["g"]))
    for group, gens in sorted(per_group.items()):
        if sorted(gens) != list(range(spec.generations)):
            problems.append(f"group {group} has generations {sorted(gens)}")
    if reference is None:
        by_group: dict[str, dict[str, float]] = {}
        for b in batches:
            for r, v in b["rewards"].items():
                m = _ROLLOUT_ID.match(r)
                if m is not None:
                    by_group.setdefault(m["group"], {})[r] = v
        bad = sorted(f"{g}: {rewards}" for g, rewards in by_group.items() if len(set(rewards.values())) > 1)
        if bad:
            problems.append(f"siblings with different rewards (continued from a wrong boundary?): {bad[:3]}")
    else:
        got = lineage_rewards(spec)
        bad = sorted(f"{g}_g{i}: {v} (crash-free run: {reference.get((g, i))})"
                     for (g, i), v in got.items() if reference.get((g, i)) != v)
        if bad:
            problems.append(f"rewards differ from the crash-free run (continued from a wrong boundary?): {bad[:5]}")
    return problems


def trained_rollout_ids(spec: RunSpec) -> set[str]:
    try:
        return {r for b in final_lineage(spec) for r in b["rollout_ids"]}
    except (OSError, ValueError, KeyError):
        return set()


def check_restore(record: dict[str, Any] | None, trained: set[str], *, final: bool) -> list[str]:
    """A restore record is consistent; for the run that finished, what it continued or restarted was trained."""
    if record is None:
        return ["no restore.json written"] if final else []
    problems = []
    restored = record.get("restored_rollout_ids") or []
    if record.get("snapshot") is not None and record["restored_turn"] != len(restored):
        problems.append(f"restored_turn {record['restored_turn']} != {len(restored)} ids")
    not_next = [r for r in restored if not (_ROLLOUT_ID.match(r) and _ROLLOUT_ID.match(r)["attempt"])]
    if not_next:
        problems.append(f"continued rollouts without an -a<N> attempt id: {not_next[:5]}")
    if final:
        for key in ("restored_rollout_ids", "restarted_rollout_ids", "kept_rollout_ids"):
            lost = sorted(set(record.get(key) or []) - trained)
            if lost:
                problems.append(f"{key} not in the trained lineage: {lost[:5]}")
    return problems


# ----------------------------------------------------------------------------- scenarios
@dataclass
class Row:
    phase: str
    outcome: str
    restored_turn: str = "-"
    restarted_from_prompt: str = "-"
    kept: str = "-"
    verdict: str = "?"
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _counts(row: Row, record: dict[str, Any] | None) -> None:
    if record is not None:
        row.restored_turn = str(record.get("restored_turn", "-"))
        row.restarted_from_prompt = str(record.get("restarted_from_prompt", "-"))
        row.kept = str(record.get("kept_siblings", "-"))


def _where(record: dict[str, Any] | None) -> str:
    if record is None:
        return "no restore"
    snap = record.get("snapshot")
    anchor = "bootstrap" if record.get("trainer_step", 0) == 0 else f"step_{record['trainer_step']}"
    return f"restored {anchor}/{Path(snap).name}" if snap else f"resumed from trainer {anchor}, no snapshot"


def _progress(spec: RunSpec) -> str:
    steps = [m["step"] for m in spec.records("metrics.jsonl")]
    snaps = sum(1 for s in spec.records("snapshots.jsonl") if s.get("committed"))
    return f"step {max(steps, default=0)} trained, {snaps} snapshots so far"


ORPHAN_GRACE_S = 10.0  # a killed run's processes must all be gone this soon


def _orphans(results: list[RunResult]) -> list[str]:
    return [f"run {r.index}: processes left {r.cleanup_s:.0f}s after it died: {r.leftover}"
            for r in results if r.leftover or r.cleanup_s > ORPHAN_GRACE_S]


def _finish(runner: Runner, row: Row, log: Callable[[str], None],
            reference: dict[tuple[str, int], float] | None) -> None:
    """Run the same command to the end and fill in the verdict."""
    final = runner.run()
    if final.returncode != 0:
        row.problems.append(f"the rerun exited {final.returncode}: {final.stderr.strip().splitlines()[-1:]}")
    _counts(row, final.restore)
    row.outcome += f"; rerun {_where(final.restore)}"
    row.problems += check_lineage(runner.spec, reference)
    row.problems += check_restore(final.restore, trained_rollout_ids(runner.spec), final=True)
    row.problems += _orphans(runner.results)
    row.verdict = "ok" if not row.problems else "FAIL"
    log(f"  -> {row.verdict}: {row.outcome}" + (f" | {'; '.join(row.problems)}" if row.problems else ""))


def _after_new_snapshots(spec: RunSpec, nth: int, extra_s: float) -> Callable[[float], bool]:
    """True ``extra_s`` after the ``nth`` snapshot this run commits (counted from when it is created)."""
    return after_committed_snapshots(spec, nth, extra_s)


def committed_in_step(spec: RunSpec, step: int, extra_s: float = 0.0) -> Callable[[float], bool]:
    """True ``extra_s`` after a snapshot of trainer step >= ``step`` that saved rollouts is committed."""
    return after_committed_in_step(spec, step, extra_s)


def scenario(phase: str, root: Path, log: Callable[[str], None] = print,
             reference: dict[tuple[str, int], float] | None = None, seed: int = 0, **spec_kw: Any) -> Row:
    """Crash one run at ``phase``, then run the same command to the end and check it."""
    started = time.monotonic()
    spec = RunSpec(root, **spec_kw)
    runner = Runner(spec, log)
    row = Row(phase, "")
    log(f"[{phase}] crash run")
    if phase in ("prepare", "commit", "persist", "publish"):
        first = runner.run(crash=f"{phase}:2")
    elif phase == "train":
        first = runner.run(crash="train:2")
    elif phase == "restore":
        pre = runner.run(crash="commit:2")
        if not pre.crashed_by_hook:
            row.problems.append(f"the run before did not crash at commit:2 (exit {pre.returncode})")
        log(f"[{phase}] crashed at commit:2 ({_progress(spec)}); restore run")
        first = runner.run(crash="restore")
    elif phase in ("between", "driver"):
        # a seeded random moment within a snapshot interval after a snapshot of step >= 1 that saved rollouts
        extra = random.Random(f"{seed}:{phase}").uniform(0.0, spec.interval_s)
        log(f"[{phase}] SIGKILL {extra:.2f}s after a snapshot of step >= 1")
        first = runner.run(kill_when=committed_in_step(spec, 1, extra), kill_driver_only=phase == "driver")
    else:
        raise ValueError(f"unknown phase {phase!r}; expected one of {ALL_PHASES}")
    if phase in HOOK_PHASES and not first.crashed_by_hook:
        row.problems.append(f"the hook did not fire (exit {first.returncode}); stderr: {first.stderr[-300:]}")
    elif phase not in HOOK_PHASES and first.killed_by not in ("group", "driver"):
        row.problems.append(f"the run was not killed (exit {first.returncode})")
    row.outcome = f"killed ({first.killed_by}) at {_progress(spec)}"
    log(f"[{phase}] {row.outcome}; rerun to the end")
    _finish(runner, row, log, reference)
    row.seconds = time.monotonic() - started
    return row


def soak(root: Path, crashes: int, seed: int, log: Callable[[str], None] = print,
         reference: dict[tuple[str, int], float] | None = None, **spec_kw: Any) -> list[Row]:
    """Kill the same run ``crashes`` times at seeded random moments, then let it finish; one row per kill.

    A third of the kills land at a random time in the first 8 s (start-up,
    Gym spin-up, restore); the rest a random fraction of a snapshot interval
    after the run's 1st, 2nd or 3rd committed snapshot, so each run makes
    bounded progress and the soak does not finish before its last kill.
    Every 4th kill hits the driver process only, as an OOM kill would.
    """
    rng = random.Random(seed)
    spec = RunSpec(root, **spec_kw)
    runner = Runner(spec, log)
    rows: list[Row] = []
    for i in range(1, crashes + 1):
        driver_only = i % 4 == 0
        if rng.random() < 1 / 3:
            at = rng.uniform(2.0, 8.0)
            when, label = (lambda elapsed, at=at: elapsed >= at), f"@{at:.1f}s"
        else:
            nth, extra = rng.randint(1, 3), rng.uniform(0.0, spec.interval_s)
            when, label = _after_new_snapshots(spec, nth, extra), f"{extra:.2f}s after snapshot {nth}"
        result = runner.run(kill_when=when, kill_driver_only=driver_only)
        if rows:  # this run restored what the previous kill left
            _counts(rows[-1], result.restore)
            rows[-1].outcome += f"; next run {_where(result.restore)}"
            rows[-1].problems += check_restore(result.restore, set(), final=False)
        if result.killed_by not in ("group", "driver"):
            log(f"[soak {i}] the run ended before the kill ({label}, exit {result.returncode}); soak stops")
            break
        where = "driver" if driver_only else "group"
        row = Row(f"random #{i}: {where} {label}", f"killed after {result.wall_s:.1f}s, {_progress(spec)}")
        row.problems += _orphans([result])
        rows.append(row)
        log(f"[soak {i}/{crashes}] SIGKILL {where} {label} ({result.wall_s:.1f}s in): {_progress(spec)}")
    final = runner.run()
    trained = trained_rollout_ids(spec)
    lineage = check_lineage(spec, reference)
    if len(rows) < crashes:
        lineage.append(f"the run finished after {len(rows)} of {crashes} kills (raise --soak-steps)")
    if rows:
        _counts(rows[-1], final.restore)
        rows[-1].outcome += f"; final run {_where(final.restore)}"
        rows[-1].problems += check_restore(final.restore, trained, final=True)
    if final.returncode != 0:
        lineage.append(f"the final run exited {final.returncode}: {final.stderr.strip().splitlines()[-1:]}")
    for row in rows:
        row.problems += lineage
        row.verdict = "ok" if not row.problems else "FAIL"
    log(f"[soak] final run: {'lineage ok' if not lineage else '; '.join(lineage)}")
    return rows


def markdown(rows: list[Row]) -> str:
    lines = ["| phase | outcome | restored_turn | restarted_from_prompt | kept | verdict |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        verdict = r.verdict if not r.problems else f"{r.verdict}: {'; '.join(r.problems)[:300]}"
        lines.append(f"| {r.phase} | {r.outcome} | {r.restored_turn} | {r.restarted_from_prompt} | {r.kept} | "
                     f"{verdict} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phases", default=",".join(ALL_PHASES), help="comma-separated, from: " + ", ".join(ALL_PHASES))
    parser.add_argument("--soak", type=int, default=20, help="random crashes in the soak (0: no soak)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--soak-steps", type=int, default=40, help="max_num_steps of the soak run")
    parser.add_argument("--workdir", default=None, help="where runs write (default: a temp dir, removed unless --keep)")
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    args = parser.parse_args(argv)
    phases = [p for p in args.phases.split(",") if p]
    unknown = [p for p in phases if p not in ALL_PHASES]
    if unknown:
        parser.error(f"unknown phase(s) {unknown}; expected some of {', '.join(ALL_PHASES)}")
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="crash-matrix-"))
    work.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    rows: list[Row] = []
    started = time.monotonic()
    try:
        if phases:
            reference = reference_rewards(work / "reference", log)
            for phase in phases:
                rows.append(scenario(phase, work / phase, log, reference, args.seed))
        if args.soak > 0:
            reference = reference_rewards(work / "soak-reference", log, steps=args.soak_steps)
            log(f"soak: {args.soak} random crashes, seed {args.seed}")
            rows += soak(work / "soak", args.soak, args.seed, log, reference, steps=args.soak_steps)
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(markdown(rows))
    failed = [r for r in rows if r.verdict != "ok"]
    print(f"\n{len(rows) - len(failed)}/{len(rows)} ok in {time.monotonic() - started:.0f}s", flush=True)
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
