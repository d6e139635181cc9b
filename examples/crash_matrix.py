"""Crash matrix: SIGKILL a GRPO run at each recovery phase, run the same command again, check the lineage.

    python examples/crash_matrix.py                      # every phase, then a soak of 20 random crashes
    python examples/crash_matrix.py --phases commit,train --soak 0
    python examples/crash_matrix.py --soak 20 --seed 7 --phases ""
    python examples/crash_matrix.py --async --phases train,refit,checkpointed --soak 0
    python examples/crash_matrix.py --async --config examples/configs/grpo_mixed_two_shards_turn.yaml --soak 0

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
  environment marker), so none holds a port;
- no step of any run trained a group more than the lookahead's versions behind
  (``max_group_version_lag`` of every ``metrics.jsonl`` row; 0 without ``--async``).

Phases (``NEMO_RL_TEST_ONLY_CRASH_AT``, see ``testkit/crash_points.py``):
prepare, commit, persist, publish, restore (a crash while restoring the snapshot
of an earlier crash), train and refit (in the 2nd step), checkpointed (step 2
just published, no snapshot under it yet; ``checkpointed:3`` and the like name
another step); plus ``between`` (a plain SIGKILL of the process group while
snapshots are being taken, no hook) and ``driver`` (SIGKILL of the driver
process only). The soak kills the same run ``--soak`` times at seeded random
times (some during start-up or restore), then lets it finish.

Prints progress lines and a markdown table: phase, outcome, restored_turn,
restarted_from_prompt, kept, verdict. Exit code 0 iff every verdict is ok.

``--async`` runs every scenario in async mode (``ASYNC_SHAPE``: lookahead 1, the
next step's groups generate while a step trains, refits and checkpoints),
``--config`` on another Gym setup (``RunSpec.config``; every run allows
restart-only servers).
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
from nemo_rl.utils.snapshot_store import list_trainer_steps  # noqa: E402
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

# prepare, commit, persist, publish, restore, train, refit, checkpointed; not validate: the matrix's runs
# do not validate (tests/functional/test_stop_signals.py stops a run there)
HOOK_PHASES = tuple(p for p in PHASES if p != "validate")
ALL_PHASES = (*HOOK_PHASES, "between", "driver")
_ROLLOUT_ID = re.compile(r"^(?P<group>.+)_g(?P<g>[0-9]+)_a[0-9a-f]+(?:-a(?P<attempt>[0-9]+))?$")


# ----------------------------------------------------------------------------- a run
# --async (and tests/functional/test_async_crash_matrix.py): lookahead 1 in file order. A kill in step N
# restores a snapshot under step N-1, taken while step N's last groups generate (one rollout: about 3
# scripted replies). At 0.6 s a reply that window holds 2 or more snapshots (0.25 s apart, plus the time
# each takes) even on 2 shards x 2 replicas; at 0.4 s it held 1 or 2 there.
ASYNC_SHAPE: dict[str, Any] = {"lookahead": 1, "shuffle": False, "interval_s": 0.25, "delay_s": 0.6}
MIXED_CONFIG = "examples/configs/grpo_mixed_turn.yaml"  # one replica
TWO_SHARDS_CONFIG = "examples/configs/grpo_mixed_two_shards_turn.yaml"  # 2 shards x 2 replicas, restart-only


@dataclass
class RunSpec(RunDirs):
    """One run's command line; the same command is used again after each crash (where it writes: RunDirs).

    ``lookahead`` > 0 is async mode: the groups of the next ``lookahead`` steps generate while a step
    trains, refits and checkpoints (``async_overrides``). ``shuffle=False`` keeps the data file's order
    (the mixed files interleave their agents, so every step holds a row whose servers save turns)."""

    steps: int = 3
    prompts: int = 4
    generations: int = 4
    interval_s: float = 0.4
    delay_s: float = 0.3
    keep_latest_k: int = 2
    extra: list[str] = field(default_factory=list)
    config: str = MIXED_CONFIG  # relative to the repository (runs start there)
    lookahead: int = 0
    shuffle: bool = True

    def async_overrides(self) -> list[str]:
        """The async-mode keys: lookahead, generation logprobs (the config requires them), streaming
        train from 2 groups, and the admission limits.

        Every scripted rollout takes about as long as any other, so groups admitted together finish
        together. ``lookahead + 1/2`` steps' worth of groups generating at once makes the waves
        straddle the steps: half of step 2's groups start with step 1's (complete, not yet trained,
        while step 1 trains and checkpoints), the rest start with step 3's, and step 3's groups
        generate while step 2 trains (streaming, from its first complete groups). The buffer holds
        the admitted steps' rollouts, so it never holds admission back here."""
        if self.lookahead <= 0:
            return []
        inflight = (2 * self.lookahead + 1) * self.prompts // 2
        return [
            f"async_rl.sampler.max_lookahead_versions={self.lookahead}",
            "grpo.use_generation_logprobs=true",
            f"async_rl.min_groups_for_streaming_train={min(2, self.prompts)}",
            f"async_rl.max_inflight_prompts={max(1, inflight)}",
            f"async_rl.max_buffered_rollouts={(self.lookahead + 1) * self.prompts * self.generations}",
        ]

    def args(self) -> list[str]:
        return [
            "--config", self.config,
            "policy.model_name=scripted-test-backend",
            "rollout_recovery.allow_restart_only_gym_servers=true",
            *self.overrides(), "logger.plot=false", *scripted_overrides(self.delay_s),
            f"grpo.max_num_steps={self.steps}",
            f"grpo.num_prompts_per_step={self.prompts}",
            f"grpo.num_generations_per_prompt={self.generations}",
            f"rollout_checkpointing.snapshot_attempt_interval_s={self.interval_s}",
            f"rollout_checkpointing.keep_latest_k={self.keep_latest_k}",
            *self.async_overrides(),
            *([] if self.shuffle else ["data.shuffle=false"]),
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
    restored = record.get("restored_rollout_ids") or []  # at their turn and by replay (``replayed_rollout_ids``)
    continued = record["restored_turn"] + record.get("restored_replay", 0)
    if record.get("snapshot") is not None and continued != len(restored):
        problems.append(f"restored_turn {record['restored_turn']} + restored_replay {record.get('restored_replay', 0)} "
                        f"!= {len(restored)} ids")
    if not set(record.get("replayed_rollout_ids") or []) <= set(restored):
        problems.append("replayed_rollout_ids not all in restored_rollout_ids")
    not_next = [r for r in restored if not (_ROLLOUT_ID.match(r) and _ROLLOUT_ID.match(r)["attempt"])]
    if not_next:
        problems.append(f"continued rollouts without an -a<N> attempt id: {not_next[:5]}")
    if final:
        for key in ("restored_rollout_ids", "restarted_rollout_ids", "kept_rollout_ids"):
            lost = sorted(set(record.get(key) or []) - trained)
            if lost:
                problems.append(f"{key} not in the trained lineage: {lost[:5]}")
    return problems


def check_version_lag(spec: RunSpec, limit: int) -> list[str]:
    """Every step row of every run (``metrics.jsonl`` of the spec's logs) whose ``max_group_version_lag``
    exceeds ``limit`` (the lookahead: no group may train on weights older than that). No row with the
    key at all is a problem too, so the check cannot pass on a run that wrote none."""
    rows = [r for r in spec.records("metrics.jsonl") if "max_group_version_lag" in r]
    if not rows:
        return [f"no metrics row in {spec.logs / 'metrics.jsonl'} has max_group_version_lag"]
    return [f"step {r.get('step')}{' (restored row)' if r.get('row_restored') else ''}: max_group_version_lag "
            f"{r['max_group_version_lag']} > {limit}" for r in rows if r["max_group_version_lag"] > limit]


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
    if not snap:
        return f"resumed from trainer {anchor}, no snapshot"
    where = f"restored {anchor}/{Path(snap).name}"
    older = record.get("snapshot_anchor_step")
    if older is not None and older != record.get("trainer_step"):  # a snapshot under an older anchor
        older_name = "bootstrap" if older == 0 else f"step_{older}"
        where = (f"restored {anchor} + {older_name}/{Path(snap).name} "
                 f"({record.get('dropped_trained_groups', '?')} groups {anchor} trained dropped)")
    if record.get("retrained_groups"):
        where += f", {record['retrained_groups']} groups re-trained"
    return where


def _progress(spec: RunSpec) -> str:
    metrics = spec.records("metrics.jsonl")
    steps = [m["step"] for m in metrics]
    snaps = sum(1 for s in spec.records("snapshots.jsonl") if s.get("committed"))
    text = f"step {max(steps, default=0)} trained, {snaps} snapshots so far"
    durable = max(list_trainer_steps(spec.ckpt), default=0) if spec.ckpt.is_dir() else 0
    if durable > max(steps, default=0):  # killed after the checkpoint, before the step's metrics row
        text = text.replace(" trained,", f" trained (step {durable} checkpointed),", 1)
    if spec.lookahead and metrics:
        text += f", {metrics[-1].get('inflight_rollouts', '?')} rollouts in flight at its end"
    return text


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
    row.problems += check_version_lag(runner.spec, runner.spec.lookahead)
    row.problems += _orphans(runner.results)
    row.verdict = "ok" if not row.problems else "FAIL"
    log(f"  -> {row.verdict}: {row.outcome}" + (f" | {'; '.join(row.problems)}" if row.problems else ""))


def _after_new_snapshots(spec: RunSpec, nth: int, extra_s: float) -> Callable[[float], bool]:
    """True ``extra_s`` after the ``nth`` snapshot this run commits (counted from when it is created)."""
    return after_committed_snapshots(spec, nth, extra_s)


def committed_in_step(spec: RunSpec, step: int, extra_s: float = 0.0) -> Callable[[float], bool]:
    """True ``extra_s`` after a snapshot of trainer step >= ``step`` that saved rollouts is committed."""
    return after_committed_in_step(spec, step, extra_s)


COUNTED_PHASES = ("prepare", "commit", "persist", "publish", "train", "refit", "checkpointed")
DEFAULT_NTH = 2  # snapshot phases: the step's 2nd snapshot (its 1st is on disk); train, refit, checkpointed: step 2


def parse_phase(text: str) -> tuple[str, int | None]:
    """``'refit'`` -> ``('refit', 2)``, ``'checkpointed:3'`` -> ``('checkpointed', 3)``; ``restore``,
    ``between`` and ``driver`` take no count. Raises naming the bad text.

    ``checkpointed`` defaults to step 2, not 1: publishing step 1 prunes ``bootstrap/`` with its
    snapshots, so after ``checkpointed:1`` no older anchor is left to restore from."""
    phase, sep, count = text.partition(":")
    if phase not in ALL_PHASES:
        raise ValueError(f"unknown phase {phase!r} in {text!r}; expected one of {', '.join(ALL_PHASES)}")
    if phase not in COUNTED_PHASES:
        if sep:
            raise ValueError(f"phase {phase!r} takes no count ({text!r})")
        return phase, None
    if not sep:
        return phase, DEFAULT_NTH
    if not count.isdigit() or int(count) < 1:
        raise ValueError(f"{text!r}: the count must be an integer >= 1")
    return phase, int(count)


def scenario(phase: str, root: Path, log: Callable[[str], None] = print,
             reference: dict[tuple[str, int], float] | None = None, seed: int = 0, **spec_kw: Any) -> Row:
    """Crash one run at ``phase`` (``train``, ``refit:3``, ...: ``parse_phase``), then run the same
    command to the end and check it."""
    started = time.monotonic()
    phase_text = phase
    phase, nth = parse_phase(phase_text)
    spec = RunSpec(root, **spec_kw)
    runner = Runner(spec, log)
    row = Row(phase_text, "")
    log(f"[{phase_text}] crash run")
    if nth is not None:  # the hook phases; train, refit, checkpointed count trained steps
        first = runner.run(crash=f"{phase}:{nth}")
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
    log(f"[{phase_text}] {row.outcome}; rerun to the end")
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
    lineage = check_lineage(spec, reference) + check_version_lag(spec, spec.lookahead)
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
    parser.add_argument("--phases", default=",".join(ALL_PHASES),
                        help="comma-separated, from: " + ", ".join(ALL_PHASES) + " (a counted phase may name its "
                             "count: train:3, checkpointed:2)")
    parser.add_argument("--soak", type=int, default=20, help="random crashes in the soak (0: no soak)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--soak-steps", type=int, default=40, help="max_num_steps of the soak run")
    parser.add_argument("--workdir", default=None, help="where runs write (default: a temp dir, removed unless --keep)")
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    parser.add_argument("--config", default=MIXED_CONFIG,
                        help=f"the run's config (default {MIXED_CONFIG}; e.g. {TWO_SHARDS_CONFIG})")
    parser.add_argument("--async", dest="async_mode", action="store_true",
                        help="async mode: async_rl.sampler.max_lookahead_versions=1 in the shape of ASYNC_SHAPE "
                             "(RunSpec.async_overrides)")
    args = parser.parse_args(argv)
    spec_kw = {"config": args.config, **(ASYNC_SHAPE if args.async_mode else {})}
    phases = [p for p in args.phases.split(",") if p]
    for phase in phases:
        try:
            parse_phase(phase)
        except ValueError as exc:
            parser.error(f"--phases: {exc}")
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="crash-matrix-"))
    work.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    rows: list[Row] = []
    started = time.monotonic()
    try:
        if phases:
            reference = reference_rewards(work / "reference", log, **spec_kw)
            for phase in phases:
                rows.append(scenario(phase, work / phase.replace(":", "-"), log, reference, args.seed, **spec_kw))
        if args.soak > 0:
            reference = reference_rewards(work / "soak-reference", log, steps=args.soak_steps, **spec_kw)
            log(f"soak: {args.soak} random crashes, seed {args.seed}")
            rows += soak(work / "soak", args.soak, args.seed, log, reference, steps=args.soak_steps, **spec_kw)
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
