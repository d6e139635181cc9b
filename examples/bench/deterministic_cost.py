"""Measurement 17: what deterministic mode (``grpo.deterministic``) costs the main job, in steps per hour.

Every run is the embedded default main job (``python examples/run_grpo.py``, no ``--config``: Workplace +
simple_agent Gym on loopback, the tiny Hugging Face model from its cached warm start, the torch generation
worker, the real ``GRPOTrainer``), started and reaped through the run harness with config overrides only:
``grpo.deterministic`` true against false, nothing else changed (``grpo.val_period=0``). The two modes
alternate within each repeat (the order reversed on odd repeats, so a drift in the machine's load does not
favour one). Steps per hour = 3600 x steps / sum of ``step_s`` over steps 2..N (step 1 carries the start);
the cost is 1 - rate(on) / rate(off) of the same repeat. Deterministic mode decodes one call at a time
(batched float results differ from a row decoded alone on CPU, so batches would change tokens) and samples
each token by a counter-based draw; the waiting share (``generation_s / step_s``) shows where it goes.

The 1-minute load average is read before and after each run and printed with the table: the figures mean
something only on a quiet machine.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from bench.common import Log, fmt, fresh_dir, make_log, md_table, summary
from testkit.run_harness import RunDirs, new_marker, read_jsonl, run_env, run_once

NAME = "deterministic_cost"
TITLE = "17. Deterministic mode (grpo.deterministic) against off on the main job: steps per hour"
MODES = ("off", "on")


def measure(*, repeats: int, workdir: Path, steps: int = 12, overrides: tuple[str, ...] = (),
            timeout_s: float = 1800.0, log: Log | None = None) -> dict[str, Any]:
    """``overrides``: more config overrides for every run (a smaller step shape for the smoke test)."""
    log = log or make_log("deterministic-cost")
    workdir = Path(workdir).resolve()
    runs = []
    for repeat in range(repeats):
        for mode in MODES if repeat % 2 == 0 else tuple(reversed(MODES)):
            run = one_run(workdir / f"{mode}-{repeat}", mode, steps, list(overrides), timeout_s)
            run.update(mode=mode, repeat=repeat)
            log(f"{mode} #{repeat}: {fmt(summary([run['steps_per_hour']]))} steps/hour, load "
                f"{run['loadavg_1m'][0]:.2f} -> {run['loadavg_1m'][1]:.2f}")
            runs.append(run)
    return {"name": NAME, "title": TITLE, "runs": runs, "rows": rows_of(runs), "goal": cost_of(runs),
            "config": {"repeats": repeats, "steps": steps, "overrides": list(overrides),
                       "setup": "embedded default main job, grpo.val_period=0, grpo.deterministic on / off"}}


def one_run(root: Path, mode: str, steps: int, overrides: list[str], timeout_s: float) -> dict[str, Any]:
    """One main-job process to its end (every process of it gone when this returns); raises naming its
    output if it did not finish."""
    root = fresh_dir(Path(root))
    dirs = RunDirs(root)
    args = [*dirs.overrides(), "logger.plot=false", "grpo.val_period=0", f"grpo.max_num_steps={steps}",
            f"grpo.deterministic={'true' if mode == 'on' else 'false'}", *overrides]
    load_before = os.getloadavg()[0]
    outcome = run_once(args, env=run_env(marker=new_marker()), stdout_path=root / "run.out",
                       stderr_path=root / "run.out", timeout_s=timeout_s)
    if outcome.returncode != 0 or outcome.killed_by:
        raise RuntimeError(f"{NAME}: the {mode} run exited {outcome.returncode} ({outcome.killed_by or 'by itself'})"
                           f"; see {root / 'run.out'}:\n{outcome.tail()}")
    metrics = [m for m in dirs.records("metrics.jsonl") if m.get("step", 0) >= 1 and "step_s" in m]
    later = [m for m in metrics if m["step"] >= 2]
    step_s = sum(float(m["step_s"]) for m in later)
    return {"command": " ".join(["python", "examples/run_grpo.py", *args]), "wall_s": outcome.wall_s,
            "loadavg_1m": [load_before, os.getloadavg()[0]], "steps": len(metrics), "measured_steps": len(later),
            "steps_per_hour": 3600.0 * len(later) / step_s if step_s > 0 else None,
            "mean_step_s": step_s / len(later) if later else None,
            "waiting_share": sum(float(m.get("generation_s", 0)) for m in later) / step_s if step_s else None,
            "gen_tokens_per_step": sum(float(m.get("num_gen_tokens", 0)) for m in later) / max(len(later), 1),
            "trained_records": len(list((dirs.logs / "trained").glob("step_*.jsonl"))),
            "stragglers": list(outcome.leftover), "snapshots": len(read_jsonl(dirs.logs / "snapshots.jsonl"))}


def rows_of(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for mode in MODES:
        ws = [w for w in runs if w["mode"] == mode]
        rows.append({"mode": mode, "runs": len(ws),
                     "steps_per_hour": summary(w["steps_per_hour"] for w in ws if w["steps_per_hour"]),
                     "step_s": summary(w["mean_step_s"] for w in ws if w["mean_step_s"]),
                     "waiting_share": summary(w["waiting_share"] for w in ws if w["waiting_share"] is not None),
                     "gen_tokens_per_step": summary(w["gen_tokens_per_step"] for w in ws),
                     "loadavg_1m": summary(x for w in ws for x in w["loadavg_1m"])})
    return rows


def cost_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """1 - rate(on) / rate(off) per repeat, in percent."""
    by = {(w["repeat"], w["mode"]): w for w in runs}
    costs = [100 * (1 - on["steps_per_hour"] / off["steps_per_hour"])
             for r in sorted({w["repeat"] for w in runs})
             if (on := by.get((r, "on"))) and (off := by.get((r, "off"))) and on["steps_per_hour"]
             and off["steps_per_hour"]]
    return {"pct": summary(costs)}


def table(res: dict[str, Any]) -> str:
    head = ["grpo.deterministic", "runs", "steps / hour (steps 2–N)", "step s", "waiting share",
            "generated tokens / step", "1-min load average"]
    body = [[r["mode"], r["runs"], fmt(r["steps_per_hour"]), fmt(r["step_s"], 1, 2),
             fmt(r["waiting_share"], 100, 0) + " %", fmt(r["gen_tokens_per_step"]), fmt(r["loadavg_1m"], 1, 2)]
            for r in res["rows"]]
    c = res["config"]
    return "\n".join([f"({c['repeats']} repeat(s) of {c['steps']} steps; "
                      + (", ".join(c["overrides"]) or "the main job's step shape") + ")", "", md_table(head, body),
                      "", verdict(res["goal"])])


def verdict(goal: dict[str, Any]) -> str:
    cost = goal["pct"]
    return (f"Deterministic mode costs {fmt(cost, 1, 1)} % of the main job's steps per hour (same-repeat pairs; "
            "one call decoded at a time, counter-based draws).")
