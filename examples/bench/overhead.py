"""Measurement 5: throughput overhead of the controller's periodic snapshots.

Real GRPO runs of ``examples/configs/grpo_workplace_turn.yaml`` (every server
saves; scripted backend with a fixed reply delay, recording trainer), one run
per mode and repeat, interleaved: no snapshots
(``snapshot_attempt_interval_s=null``), a snapshot every T seconds, T =
``turns`` x the typical turn (default 10 and 3 turns), and a snapshot every
fixed ``seconds`` (default 1 s). The typical turn (one
model call plus its tools) is measured in the first no-snapshot run: the
policy model server logs every generation (``instrument/sitecustomize.py``),
and a turn is the median gap between consecutive model calls of one rollout.

Metric: rollouts per minute of generation = samples / ``generation_s`` over
the steps after the first (from ``metrics.jsonl``); overhead = 1 - rate(T) /
rate(none) of the same repeat. A snapshot closes dispatch and holds replies
for its pause, and the step waits for its last rollout, so the pauses show up
in ``generation_s`` directly.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.common import (
    DEFAULT_VARIANTS,
    Log,
    Variant,
    controller_run,
    fmt,
    generation_rate,
    make_log,
    md_table,
    summary,
)

NAME = "overhead"
TITLE = "5. Overhead: rollouts per minute with the controller's snapshots every T seconds versus none"
CONFIG = "examples/configs/grpo_workplace_turn.yaml"


def measure(*, repeats: int, workdir: Path, steps: int = 8, prompts: int = 8, generations: int = 4,
            turns: tuple[float, ...] = (10, 3), seconds: tuple[float, ...] = (1.0,), delay_s: float = 0.5,
            goal_pct: float = 3.0,
            variants: list[Variant] | None = None, log: Log | None = None, timeout_s: float = 300.0) -> dict[str, Any]:
    log = log or make_log("overhead")
    variants = variants or DEFAULT_VARIANTS
    base = [f"grpo.max_num_steps={steps}", f"grpo.num_prompts_per_step={prompts}",
            f"grpo.num_generations_per_prompt={generations}", "rollout_checkpointing.max_consecutive_failures=1000"]
    turn_s: float | None = None
    raw: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in range(repeats):
        for label, extra in [("", [])] + variants:
            modes = [("none", None)] if not label else _modes(turns, seconds)
            for mode, t in modes:
                key = "none" if t is None else f"{label}/{mode}"
                interval = None if t is None else _interval(mode, t, turn_s)
                over = [*base, f"rollout_checkpointing.snapshot_attempt_interval_s={interval if interval else 'null'}",
                        *extra]
                root = Path(workdir) / f"overhead-{key.replace('/', '-')}-{r}"
                run = controller_run(root, config=CONFIG, overrides=over, delay_s=delay_s, timeout_s=timeout_s,
                                     extra_env={"BENCH_AUDIT_DIR": str(root / "audit")} if turn_s is None else None)
                if run.outcome.returncode != 0:
                    raise RuntimeError(f"overhead {key}: run exited {run.outcome.returncode}; "
                                       f"see {run.dirs.root}/run.out:\n{run.outcome.tail()}")
                if turn_s is None:
                    turn_s = _typical_turn(root / "audit")
                    log(f"typical turn {turn_s * 1e3:.0f} ms -> intervals "
                        + ", ".join(f"{t:g} turns = {t * turn_s:.2f}s" for t in turns))
                rate = generation_rate(run, skip_steps=1)
                snaps = [s for s in run.snapshots if s.get("step", 0) >= 1]
                raw[key].append({"repeat": r, "per_min": rate["per_min"], "generation_s": rate["generation_s"],
                                 "samples": rate["samples"], "interval_s": interval,
                                 "snapshots": len(run.snapshots),
                                 "committed": sum(1 for s in run.snapshots if s.get("committed")),
                                 "pauses": [s["pause_s"] for s in snaps],
                                 "persists": [s["persist_s"] for s in snaps if s.get("persist_s") is not None],
                                 "command": run.command})
                w = raw[key][-1]
                log(f"repeat {r + 1}/{repeats} {key}: {w['per_min']:.0f} rollouts/min of generation, "
                    f"{w['snapshots']} snapshots")
    rows = []
    none = raw["none"]
    rows.append({"mode": "none", "variant": "", "turns": None, "interval_s": None,
                 "rollouts_per_min": summary(w["per_min"] for w in none), "raw": none})
    for label, _ in variants:
        for mode, t in _modes(turns, seconds):
            key = f"{label}/{mode}"
            ws = raw[key]
            over = [100 * (1 - w["per_min"] / n["per_min"]) for w, n in zip(ws, none) if n["per_min"]]
            rows.append({"mode": mode, "variant": label, "turns": t if mode.startswith("T") else None,
                         "seconds": t if mode.startswith("S") else None, "interval_s": ws[0]["interval_s"],
                         "rollouts_per_min": summary(w["per_min"] for w in ws),
                         "overhead_pct": summary(over), "snapshots": summary(w["snapshots"] for w in ws),
                         "pause_s": summary(p for w in ws for p in w["pauses"]),
                         "persist_s": summary(p for w in ws for p in w["persists"]), "raw": ws})
    ref = [w["per_min"] for w in none if w["per_min"]]
    spread = (max(ref) - min(ref)) / statistics.median(ref) * 100 if len(ref) >= 2 else None
    first = next((r for r in rows if r["variant"] == variants[0][0] and r["turns"] == 10), None)
    med = first["overhead_pct"]["median"] if first else None
    goal = {"max_overhead_pct_at_10_turns": goal_pct, "overhead_pct_median": med,
            "met": None if med is None else med <= goal_pct, "reference_spread_pct": spread,
            "fixed_interval_overhead_pct_median": {
                f"{r['variant']}/{r['seconds']:g}s": r["overhead_pct"]["median"] for r in rows
                if r.get("seconds") is not None}}
    return {"name": NAME, "title": TITLE, "rows": rows, "goal": goal,
            "config": {"repeats": repeats, "steps": steps, "prompts": prompts, "generations": generations,
                       "backend_delay_s": delay_s, "typical_turn_s": turn_s, "turns": list(turns),
                       "seconds": list(seconds),
                       "variants": [{"label": v[0], "overrides": v[1]} for v in variants],
                       "setup": f"{CONFIG}, scripted backend, recording trainer"}}


def _modes(turns: tuple[float, ...], seconds: tuple[float, ...]) -> list[tuple[str, float]]:
    """``T<n>``: every n typical turns; ``S<s>``: every s seconds."""
    return [(f"T{t:g}", float(t)) for t in turns] + [(f"S{s:g}", float(s)) for s in seconds]


def _interval(mode: str, value: float, turn_s: float | None) -> float:
    return round(value if mode.startswith("S") else value * (turn_s or 0.0), 3)


def interval_label(row: dict[str, Any]) -> str:
    if row.get("turns") is not None:
        return f"T = {row['turns']:g} turns = {row['interval_s']:.2f} s"
    return f"every {row['seconds']:g} s"


def _typical_turn(audit: Path) -> float:
    """Median gap between consecutive generations of one rollout (model call + its tools)."""
    times: dict[str, list[float]] = defaultdict(list)
    for path in audit.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            if line.strip():
                c = json.loads(line)
                if c.get("status") == 200 and c.get("key"):
                    times[c["key"]].append(c["t"])
    gaps = [b - a for ts in times.values() for a, b in zip(sorted(ts), sorted(ts)[1:])]
    if not gaps:
        raise RuntimeError(f"no model calls recorded in {audit}; is instrument/sitecustomize.py on PYTHONPATH?")
    return statistics.median(gaps)


def table(res: dict[str, Any]) -> str:
    several = len(res["config"]["variants"]) > 1
    head = (["variant"] if several else []) + [
        "snapshots every", "rollouts / min of generation", "overhead vs none (same repeat)", "snapshots per run",
        "pause per snapshot ms", "persist after resume ms"]
    body = []
    turn = res["config"]["typical_turn_s"] or 0.0
    for r in res["rows"]:
        if r["mode"] == "none":
            body.append(([""] if several else []) + ["never (reference)", fmt(r["rollouts_per_min"]), "—", "—", "—",
                                                     "—"])
            continue
        body.append(([r["variant"]] if several else []) + [
            interval_label(r), fmt(r["rollouts_per_min"]),
            f"{fmt(r['overhead_pct'], 1, 1)} %", fmt(r["snapshots"]), fmt(r["pause_s"], 1e3),
            fmt(r["persist_s"], 1e3) if r["persist_s"].get("max") else "—"])
    spread = res["goal"].get("reference_spread_pct")
    note = f"\n\nTypical turn: {turn * 1e3:.0f} ms (model call + its tools)."
    if spread is not None:
        note += (f" The no-snapshot runs alone differ by {spread:.1f}% between repeats (max − min over median): "
                 "overheads smaller than that are within noise.")
    return md_table(head, body) + note
