"""Record sizes: what a rollout snapshot and a trainer checkpoint store, over a long run.

    python examples/bench/record_sizes.py                        # 300 steps (about 3 minutes on 2 cores)
    python examples/bench/record_sizes.py --steps 60 --at 10,30,60 --out /tmp/sizes

One real ``examples/run_grpo.py`` run of ``examples/configs/grpo_workplace_turn.yaml``
(scripted backend, recording trainer), started and reaped through the run
harness: 1 prompt x 2 generations per step, a trainer checkpoint every step
and every step kept (``checkpointing.keep_top_k=null``), a rollout snapshot
every ``interval_s``. Afterwards, for every step N:

- ``controller_state.json``: bytes of the newest rollout snapshot under
  ``step_N/`` (a step that finished before the next snapshot has none);
- trainer state: what the controller hands the trainer at step N (``step``,
  ``dataloader``, ``ledger``), encoded as the GRPO trainer writes it into
  ``trainer_state.json`` (``json.dumps(indent=1)``). The recording trainer
  keeps it as ``extra_state`` in ``recording_trainer.json``; that file's
  ``batches`` are the test fake's lineage, which grows by design and is
  reported apart;
- Gym's staged copy (``captured_bytes`` of the snapshot in ``snapshots.jsonl``);
- for comparison, what ledger schema 1 added: its list of trained group ids,
  computed from the lineage (once in ``controller_state.json``, twice in the
  trainer state).

Prints progress lines and a markdown table at the ``--at`` steps, writes
``<out>/record_sizes.json`` and ``<out>/record_sizes.png``. A size that stays
flat shows as a slope of about 0 bytes per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
if str(REPO / "examples") not in sys.path:
    sys.path.insert(0, str(REPO / "examples"))

from bench.common import SCRIPTED, Log, fresh_dir, make_log, md_table  # noqa: E402
from testkit.run_harness import JsonlFollower, RunDirs, run_env, run_once, scripted_overrides  # noqa: E402

NAME = "record_sizes"
TITLE = "Record sizes: controller_state.json and trainer state versus trainer steps"
CONFIG = "examples/configs/grpo_workplace_turn.yaml"
DEFAULT_AT = (10, 50, 100, 200, 300)


def measure(*, workdir: Path, steps: int = 300, prompts: int = 1, generations: int = 2, delay_s: float = 0.05,
            interval_s: float = 0.2, timeout_s: float = 900.0, log: Log | None = None) -> dict[str, Any]:
    """Run once and read every step's records (see the module docstring)."""
    log = log or make_log(NAME)
    root = fresh_dir(Path(workdir).resolve() / "run")
    dirs = RunDirs(root)
    args = ["--config", CONFIG, SCRIPTED, f"grpo.max_num_steps={steps}", f"grpo.num_prompts_per_step={prompts}",
            f"grpo.num_generations_per_prompt={generations}", "checkpointing.save_period=1",
            "checkpointing.keep_top_k=null", f"rollout_checkpointing.snapshot_attempt_interval_s={interval_s}",
            "rollout_checkpointing.max_consecutive_failures=1000", *dirs.overrides(), "logger.plot=false",
            *scripted_overrides(delay_s)]
    metrics = JsonlFollower(dirs.logs / "metrics.jsonl")
    last_log = [time.monotonic()]

    def progress(_elapsed: float) -> bool:
        metrics.poll()
        if time.monotonic() - last_log[0] >= 10.0:
            last_log[0] = time.monotonic()
            done = max((m.get("step", 0) for m in metrics.records()), default=0)
            log(f"step {done}/{steps}")
        return False  # never kill: the run goes to its end

    log(f"{steps} steps of {prompts} prompt(s) x {generations} generations, a snapshot every {interval_s}s")
    started = time.monotonic()
    outcome = run_once(args, env=run_env(), stdout_path=root / "run.out", stderr_path=root / "run.out",
                       kill_when=progress, timeout_s=timeout_s, poll_s=0.5)
    wall_s = time.monotonic() - started
    if outcome.returncode != 0:
        raise RuntimeError(f"the run failed ({outcome.returncode}, killed_by={outcome.killed_by}):\n{outcome.tail(20)}")
    log(f"run finished in {wall_s:.0f}s; reading {steps} trainer steps")
    rows = read_steps(dirs, steps)
    return {"name": NAME, "title": TITLE, "rows": rows, "wall_s": round(wall_s, 1),
            "slopes": {k: slope(rows, k) for k in ("controller_state_bytes", "trainer_state_bytes")},
            "config": {"steps": steps, "prompts": prompts, "generations": generations, "backend_delay_s": delay_s,
                       "snapshot_interval_s": interval_s, "command": " ".join(["python", "examples/run_grpo.py",
                                                                               *args])}}


def trainer_state_bytes(extra: dict[str, Any]) -> int:
    """The controller's part of ``trainer_state.json`` as the GRPO trainer encodes it."""
    return len(json.dumps(extra, indent=1).encode())


def read_steps(dirs: RunDirs, steps: int) -> list[dict[str, Any]]:
    """One row per trainer step: the sizes of what it stored (None where it stored no snapshot)."""
    captured = {}  # by path: a record's "step" is read when it is written, which may be the next step already
    for s in dirs.records("snapshots.jsonl"):
        if s.get("committed") and s.get("path"):
            captured[str(Path(s["path"]).resolve())] = s.get("captured_bytes")
    rows = []
    lineage: list[str] = []
    for n in range(1, steps + 1):
        anchor = dirs.ckpt / f"step_{n}"
        state = json.loads((anchor / "recording_trainer.json").read_text())
        extra = state["extra_state"]
        lineage = [g for b in state["batches"] for g in b["groups"]]
        snaps = sorted((anchor / "rollout_snapshots").glob("snapshot_*/controller_state.json"),
                       key=lambda p: int(p.parent.name.split("_")[-1]))
        newest = snaps[-1] if snaps else None
        ids = json.dumps(lineage, indent=2)
        ledger = extra["ledger"]
        rows.append({
            "step": n,
            "controller_state_bytes": newest.stat().st_size if newest else None,
            "gym_captured_bytes": captured.get(str(newest.parent.resolve())) if newest else None,
            "trainer_state_bytes": trainer_state_bytes(extra),
            "recording_trainer_bytes": (anchor / "recording_trainer.json").stat().st_size,
            "trained_count": ledger["trained_count"],
            "trained_positions": ledger["trained_positions"],
            "groups_in_ledger": len(ledger["groups"]),
            "schema1_list_bytes": len(ids.encode()),
        })
    return rows


def slope(rows: list[dict[str, Any]], key: str) -> float | None:
    """Least-squares bytes per step of ``key`` over every step that has it."""
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    if len(pts) < 2:
        return None
    mx = statistics.fmean(x for x, _ in pts)
    my = statistics.fmean(y for _, y in pts)
    den = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / den if den else None


def nearest(rows: list[dict[str, Any]], step: int, key: str) -> dict[str, Any] | None:
    """The row of ``step`` if it has ``key``, else of the newest earlier step that has it, else of the first
    later one (a step that ends before the next snapshot interval has no snapshot)."""
    for r in [*reversed(rows[:step]), *rows[step:]]:
        if r.get(key) is not None:
            return r
    return None


def table(res: dict[str, Any], at: tuple[int, ...] = DEFAULT_AT) -> str:
    rows = res["rows"]
    head = ["step", "controller_state.json B", "trainer state B", "trained (count, ranges)",
            "schema 1 would add to controller_state.json / trainer state ≈ B",
            "Gym staged copy B (that snapshot; varies with the rollouts' phase)",
            "recording_trainer.json B (test fake's lineage)"]
    body = []
    for step in [s for s in at if s <= len(rows)]:
        row = rows[step - 1]
        snap = nearest(rows, step, "controller_state_bytes")
        where = "" if snap is None or snap["step"] == step else f" (step {snap['step']})"
        body.append([
            step,
            "—" if snap is None else f"{snap['controller_state_bytes']:,}{where}",
            f"{row['trainer_state_bytes']:,}",
            f"{row['trained_count']}, {row['trained_positions']}",
            f"{row['schema1_list_bytes']:,} / {2 * row['schema1_list_bytes']:,}",
            "—" if snap is None or snap["gym_captured_bytes"] is None else f"{snap['gym_captured_bytes']:,}{where}",
            f"{row['recording_trainer_bytes']:,}",
        ])
    s = res["slopes"]
    note = (f"Least-squares slope over all {len(rows)} steps: controller_state.json "
            f"{_per_step(s['controller_state_bytes'])}, trainer state {_per_step(s['trainer_state_bytes'])}. "
            f"Run: {res['config']['prompts']} prompt(s) x {res['config']['generations']} generations per step, "
            f"{res['wall_s']:.0f} s.")
    return md_table(head, body) + "\n\n" + note


def _per_step(v: float | None) -> str:
    return "—" if v is None else f"{v:+.3f} B/step"


def plot(res: dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    fig, ax = plt.subplots(figsize=(9, 5))

    def series(key: str, scale: int = 1, offset_key: str | None = None):
        pts = [(r["step"], r[key] + (scale * r[offset_key] if offset_key else 0))
               for r in rows if r.get(key) is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    ax.plot(*series("controller_state_bytes"), "o", ms=2.5, color="tab:blue", label="controller_state.json")
    ax.plot(*series("trainer_state_bytes"), "-", color="tab:orange", label="trainer state (controller's part)")
    ax.plot(*series("controller_state_bytes", 1, "schema1_list_bytes"), ".", ms=1.5, color="tab:blue", alpha=0.35,
            label="controller_state.json with schema 1's id list (computed)")
    ax.plot(*series("trainer_state_bytes", 2, "schema1_list_bytes"), "--", color="tab:orange", alpha=0.6,
            label="trainer state with schema 1's two id lists (computed)")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("bytes")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Record sizes over {len(rows)} steps ({res['config']['prompts']} prompt x "
                 f"{res['config']['generations']} generations per step)")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{NAME}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--at", default=",".join(map(str, DEFAULT_AT)), help="steps shown in the table")
    p.add_argument("--prompts", type=int, default=1)
    p.add_argument("--generations", type=int, default=2)
    p.add_argument("--delay", type=float, default=0.05, help="the scripted backend's reply delay, seconds")
    p.add_argument("--interval", type=float, default=0.2, help="rollout_checkpointing.snapshot_attempt_interval_s")
    p.add_argument("--out", default="bench_results")
    p.add_argument("--workdir", default=None, help="where the run writes (default: <out>/record_sizes-work)")
    args = p.parse_args(argv)
    out = Path(args.out)
    res = measure(workdir=Path(args.workdir) if args.workdir else out / f"{NAME}-work", steps=args.steps,
                  prompts=args.prompts, generations=args.generations, delay_s=args.delay, interval_s=args.interval)
    at = tuple(int(s) for s in args.at.split(",") if s.strip())
    print(f"\n## {TITLE}\n\n{table(res, at)}\n", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{NAME}.json").write_text(json.dumps(res, indent=1))
    print(f"Wrote {out / f'{NAME}.json'} and {plot(res, out)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
