"""The recovery parity harness: ``python examples/recovery_parity.py --config X.yaml [--faults SPEC] [k=v ...]``.

It runs the config twice with ``grpo.deterministic=true``, each in a directory of its own: once without a
fault (the reference; or ``--reference DIR``, a finished one) and once under the fault schedule
(``faults``: kills and relaunches, a SIGTERM, another replica count, in-run losses of a Gym server, a
replica, the generation worker, a stopped server; by default one of each). Then it compares what each
step trained (``compare``) and prints the faults delivered, one table and the first difference. Exit
status: 0 parity; 1 a difference, a fault not delivered (the run ended first: give it more steps), or a
run that failed; 2 a bad argument or config (named).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from nemo_rl.parity.compare import ParityReport, Tolerance, compare_runs, render
from nemo_rl.parity.drive import DriveOutcome, FaultDriver
from nemo_rl.parity.faults import Schedule, default_spec, parse_schedule
from nemo_rl.parity.launch import PRODUCT_ENTRY, RunCommand, RunPlace

USAGE = "recovery_parity.py --config FILE.yaml [--faults SPEC] [--workdir DIR] [--reference DIR] [key=value ...]"


@dataclass
class RunShape:
    """What the harness needs to know of the config (loaded and checked before anything starts)."""

    steps: int
    shards: list[str]
    replicas: int
    lookahead: int
    in_run: bool
    snapshots: bool
    level: str


@dataclass
class ParityResult:
    report: ParityReport | None
    reference: DriveOutcome | None
    faulted: DriveOutcome | None
    error: str | None = None

    @property
    def exit_code(self) -> int:
        if self.error is not None or self.report is None or (self.faulted and self.faulted.undelivered):
            return 1
        return 0 if self.report.ok else 1


def run_shape(config: str | None, overrides: list[str]) -> RunShape:
    """The config as a run would load it, with deterministic mode on; ``ValueError`` naming what is wrong."""
    from nemo_rl.algorithms.single_controller_utils.config import load_config

    cfg = load_config(config, [*overrides, "grpo.deterministic=true"])
    shards = cfg.env.nemo_gym.shards
    return RunShape(steps=cfg.grpo.max_num_steps, shards=[s.name for s in shards], replicas=shards[0].replicas,
                    lookahead=cfg.async_rl.lookahead, in_run=cfg.rollout_recovery.in_run.enabled,
                    snapshots=cfg.checkpointing.enabled and cfg.rollout_checkpointing.snapshot_attempt_interval_s
                    is not None, level=str(cfg.rollout_recovery.target_level.value))


def check_schedule(schedule: Schedule, shape: RunShape) -> None:
    """Refuse faults this config cannot survive or the harness cannot time, naming the key to change."""
    if schedule.faults and not shape.snapshots:
        raise ValueError("the faults are timed by committed snapshots: set checkpointing.enabled=true and "
                         "rollout_checkpointing.snapshot_attempt_interval_s")
    if schedule.in_run and not shape.in_run:
        raise ValueError("in-run faults (server, stop, replica, worker) need rollout_recovery.in_run.enabled=true")


def _fresh(root: Path) -> None:
    if root.exists() and any(root.iterdir()):
        raise ValueError(f"{root} is not empty: give --workdir a new directory (a run there would restore "
                         "from what is in it)")


def run_reference(config: str | None, overrides: list[str], root: Path, *, entry: tuple[str, ...] = PRODUCT_ENTRY,
                  env: dict[str, str] | None = None, launch_timeout_s: float = 3600.0,
                  log: Callable[[str], None] = print) -> tuple[RunPlace, DriveOutcome]:
    """The run without faults, in ``root`` (which must be new or empty): what ``--reference`` takes."""
    shape = run_shape(config, overrides)
    place = RunPlace(Path(root).resolve())
    _fresh(place.root)
    log("reference run (no faults)")
    outcome = FaultDriver(RunCommand(config, overrides, entry, env), place, Schedule(), shards=shape.shards,
                          launch_timeout_s=launch_timeout_s, log=log).run()
    return place, outcome


def run_parity(config: str | None, overrides: list[str], spec: str | None, workdir: Path, *,
               reference: Path | None = None, seed: int = 0, tol: Tolerance = Tolerance(),
               entry: tuple[str, ...] = PRODUCT_ENTRY, env: dict[str, str] | None = None,
               faulted_env: dict[str, str] | None = None, launch_timeout_s: float = 3600.0,
               log: Callable[[str], None] = print) -> ParityResult:
    """Run the reference (unless ``reference`` names a finished one) and the faulted run, compare them.
    ``entry``/``env``: how runs are started (default: the product's entry, this environment);
    ``faulted_env``: the faulted run's environment, when it differs."""
    shape = run_shape(config, overrides)
    schedule = parse_schedule(spec if spec is not None else default_spec(shape.replicas), seed, shape.steps)
    check_schedule(schedule, shape)
    workdir = Path(workdir).resolve()
    faulted_place = RunPlace(workdir / "faulted")
    _fresh(faulted_place.root)
    log(f"level {shape.level}, {shape.steps} steps, lookahead {shape.lookahead}; faults:")
    for line in schedule.describe():
        log(f"  {line}")
    ref_outcome = None
    if reference is None:
        ref_place, ref_outcome = run_reference(config, overrides, workdir / "reference", entry=entry, env=env,
                                               launch_timeout_s=launch_timeout_s, log=log)
        if ref_outcome.error is not None:
            return ParityResult(None, ref_outcome, None, f"the reference run failed: {ref_outcome.error}")
    else:
        ref_place = RunPlace(Path(reference).resolve())
    log("faulted run")
    faulted = FaultDriver(RunCommand(config, overrides, entry, faulted_env if faulted_env is not None else env),
                          faulted_place, schedule, shards=shape.shards, prefix=shape.level == "prefix",
                          launch_timeout_s=launch_timeout_s, log=log).run()
    if faulted.error is not None:
        return ParityResult(None, ref_outcome, faulted, f"the faulted run failed: {faulted.error}")
    report = compare_runs(ref_place.logs, ref_place.ckpt, faulted_place.logs, faulted_place.ckpt,
                          steps=shape.steps, tol=tol, async_mode=shape.lookahead > 0)
    if shape.lookahead > 0:
        report.notes.append("async (lookahead > 0): a call that ran at another weight version in one run is not "
                            "comparable; see docs/usage.md")
    return ParityResult(report, ref_outcome, faulted)


def render_result(result: ParityResult) -> str:
    lines = []
    if result.faulted is not None:
        lines.append("| fault | what | after snapshot | launch |")
        lines.append("|---|---|---|---|")
        for row in result.faulted.delivered:
            lines.append(f"| {row['n']}. {row['fault']} | {row['what']} | {row['after_snapshot']} | {row['launch']} |")
        for spec in result.faulted.undelivered:
            lines.append(f"| {spec} | NOT DELIVERED: the run ended first (give it more steps) | - | - |")
        lines.append("")
    if result.report is not None:
        lines.append(render(result.report))
    if result.error is not None:
        lines.append(f"error: {result.error}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="recovery_parity.py", usage=USAGE, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="the run's YAML config (default: the embedded default)")
    p.add_argument("--faults", default=None,
                   help="comma-separated faults, in order (nemo_rl/parity/faults.py): kill, kill:replicas=N, term, "
                        "term:replicas=N, server[:name], stop[:name], replica, worker; default: one of each")
    p.add_argument("--workdir", default=None, help="where both runs write (default: ./parity-<time>)")
    p.add_argument("--reference", default=None, help="a finished reference run's directory (its logs/ and ckpt/)")
    p.add_argument("--seed", type=int, default=0, help="seed of the faults' timing (which committed snapshot)")
    p.add_argument("--rtol", type=float, default=1e-5)
    p.add_argument("--atol", type=float, default=1e-6)
    p.add_argument("--launch-timeout", type=float, default=3600.0, help="seconds one launch may run")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, overrides = parser.parse_known_args(argv)
    flags = [a for a in overrides if a.startswith("-")]
    if flags:
        print(f"error: unknown option {flags[0]}\nusage: {USAGE}", file=sys.stderr)
        return 2
    workdir = Path(args.workdir or f"parity-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        result = run_parity(args.config, overrides, args.faults, workdir,
                            reference=Path(args.reference) if args.reference else None, seed=args.seed,
                            tol=Tolerance(args.rtol, args.atol), launch_timeout_s=args.launch_timeout)
    except ValueError as exc:  # a bad config, fault spec or directory, named
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(render_result(result))
    print(f"runs kept in {workdir.resolve()}")
    return result.exit_code
