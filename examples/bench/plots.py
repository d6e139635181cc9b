"""PNG plots of the recovery benchmark (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _err(s: dict[str, Any], scale: float = 1.0) -> tuple[float, list[float]]:
    med = s["median"] * scale
    return med, [med - s["min"] * scale, s["max"] * scale - med]


def _bars(ax, labels, stats, scale=1.0, color=None):
    meds, lows, highs = [], [], []
    for s in stats:
        if s and s.get("median") is not None:
            m, (lo, hi) = _err(s, scale)
        else:
            m, lo, hi = 0.0, 0.0, 0.0
        meds.append(m)
        lows.append(lo)
        highs.append(hi)
    ax.bar(range(len(labels)), meds, yerr=[lows, highs], capsize=4, color=color)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=0)
    return meds


def _line(ax, rows, field, scale, fmt, color, label):
    rows = [r for r in rows if r.get(field) and r[field].get("n")]
    if not rows:
        return
    meds = [r[field]["median"] * scale for r in rows]
    errs = [[m - r[field]["min"] * scale for m, r in zip(meds, rows)],
            [r[field]["max"] * scale - m for m, r in zip(meds, rows)]]
    ax.errorbar([r["n"] for r in rows], meds, yerr=errs, fmt=fmt, color=color, capsize=3, label=label)


def snapshot_cost(res: dict[str, Any], path: Path) -> Path:
    from bench.snapshot_cost import basis

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    styles = {"disk": "-", "tmpfs": "--"}
    variants = [v["label"] for v in res["config"]["variants"]]
    for vi, variant in enumerate(variants):
        tag = f"{variant}, " if len(variants) > 1 else ""
        for storage in ("disk", "tmpfs"):
            # the steady attempts' figures, as the goals use them (all kept ones for older results)
            rows = [{**r, **basis(r)} for r in res["rows"] if r["variant"] == variant and r["storage"] == storage]
            if not rows:
                continue
            style = "o" + styles[storage] if vi == 0 else "s" + styles[storage]
            fields = (("pause_s", "C0"), ("prepare_s", "C1"), ("commit_s", "C2"), ("publish_s", "C3"),
                      ("persist_s", "C5")) if storage == "disk" else (("pause_s", "C0"),)
            for field, color in fields:
                _line(axes[0], rows, field, 1e3, style, color, f"{field[:-2]} ({tag}{storage})")
            _line(axes[1], rows, "excess_s", 1e3, style, "C0", f"pause − tool time left ({tag}{storage})")
            _line(axes[1], rows, "tool_pause_s", 1e3, style, "C7", f"pause ({tag}{storage})")
            if storage == "disk":
                _line(axes[2], rows, "bytes", 1e-6, style, "C4", f"{tag}MB per snapshot")
    goal = res["goal"].get("pause_within_ms_of_longest_tool")
    if goal:
        axes[1].axhline(goal, color="red", linestyle=":", label=f"goal: {goal:g} ms")
    for ax, title, ylabel in ((axes[0], "Controller's snapshot pause and its parts (tools instant)", "ms"),
                              (axes[1], f"Pause with {res['config']['tool_s']:g}s tool calls in flight", "ms"),
                              (axes[2], "Bytes per published snapshot", "MB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("rollouts in flight (N)")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle("Snapshot cost versus rollouts in flight, through the controller (median, bars: min–max)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def stall(res: dict[str, Any], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    rows = res["rows"]
    labels = [r["policy"] if len(rows) <= 2 else f"{r['variant']}\n{r['policy']}" for r in rows]
    meds = _bars(ax, labels, [r["time_per_attempt_s"] for r in rows], color=["C3", "C2"] * (len(rows) // 2))
    for i, r in enumerate(rows):
        ax.text(i, meds[i], f"{r['committed']}/{r['attempts']} committed", ha="center", va="bottom")
    ax.set_ylabel("seconds per snapshot attempt")
    ax.set_title(f"Stall with a restart-only agent (prepare deadline {res['config']['prepare_deadline_s']:g}s)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def work_lost(res: dict[str, Any], path: Path) -> Path:
    rows = res["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    labels = [f"{r['setup']}\n{r['level']}" for r in rows]
    _bars(axes[0], labels, [r["regen_calls"] for r in rows], color="C0")
    axes[0].set_ylabel("model calls regenerated per crash")
    axes[0].set_title("Model calls generated again after restore (per crash)", fontsize=10)
    _bars(axes[1], labels, [r["regen_tokens"] for r in rows], color="C1")
    axes[1].set_ylabel("tokens regenerated per crash")
    axes[1].set_title("Generated tokens produced again after restore (per crash)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def alternative(res: dict[str, Any], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = {"none": "baseline loop:\nno snapshots", "alternative": "baseline loop:\nretire blockers\n+ prepare again",
              "controller_none": "controller:\nno snapshots", "best_effort": "controller:\nbest effort"}
    rows = res["rows"]
    kept = {"alternative": res["comparison"].get("alternative_vs_none"),
            "best_effort": res["comparison"].get("best_effort_vs_none")}
    meds = _bars(ax, [labels[r["mode"]] for r in rows], [r["rollouts_per_min"] for r in rows],
                 color=["C7", "C3", "C7", "C2"][: len(rows)])
    for i, r in enumerate(rows):
        if kept.get(r["mode"]) is not None:
            ax.text(i, meds[i], f"{kept[r['mode']] * 100:.0f}% of its reference", ha="center", va="bottom",
                    fontsize=8)
    ax.set_ylabel("rollouts completed per minute")
    ax.set_title(f"Restart-only agent, snapshot every {res['config']['interval_s']:g}s "
                 f"(rollout ≈ {res['config']['rollout_s_median']:.2f}s)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def overhead(res: dict[str, Any], path: Path) -> Path:
    rows = res["rows"]
    fig, ax = plt.subplots(figsize=(max(7, 1.6 * len(rows)), 4.4))
    several = len({r["variant"] for r in rows if r["mode"] != "none"}) > 1
    labels = ["none" if r["mode"] == "none" else
              f"{r['variant'] + chr(10) if several else ''}every {r['turns']:g} turns\n({r['interval_s']:.1f}s)"
              if r.get("turns") is not None else f"{r['variant'] + chr(10) if several else ''}every {r['seconds']:g}s"
              for r in rows]
    meds = _bars(ax, labels, [r["rollouts_per_min"] for r in rows],
                 color=["C7"] + [f"C{i % 10}" for i in range(len(rows) - 1)])
    for i, r in enumerate(rows):
        if r["mode"] != "none":
            ax.text(i, meds[i], f"{r['overhead_pct']['median']:+.1f}%", ha="center", va="bottom")
    ax.set_ylabel("rollouts per minute of generation")
    ax.set_title("Controller throughput with periodic snapshots (Workplace, every server saves)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def setup_check(res: dict[str, Any], path: Path) -> Path:
    parts = {r["part"]: r["seconds"]["median"] for r in res["rows"]}
    stack = [("python_imports_config_s", "Python + imports + config"), ("ray_init_s", "ray.init"),
             ("before_gym_s", "other"), ("gym_start_s", "Gym actor + servers"), ("discover_and_check_s", "discover + check"),
             ("shutdown_s", "shutdown before exit")]
    fig, ax = plt.subplots(figsize=(9, 2.6))
    left = 0.0
    for i, (key, label) in enumerate(stack):
        v = parts.get(key) or 0.0
        ax.barh([0], [v], left=left, color=f"C{i}", label=f"{label}: {v:.1f}s")
        left += v
    ax.set_yticks([])
    ax.set_xlabel("seconds since launch")
    ax.set_title(f"Mixed config as shipped: error after {parts.get('to_error_s', 0):.1f}s, "
                 f"exit after {parts.get('total_s', 0):.1f}s (medians)", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def relaunch(res: dict[str, Any], path: Path) -> Path:
    """Stacked bar per launch kind: the median of each startup phase, with the median total."""
    rows = res["rows"]
    phases = list(dict.fromkeys(p for r in rows for p in r["phases_s"]))
    fig, ax = plt.subplots(figsize=(10, 3.2))
    for i, r in enumerate(rows):
        left = 0.0
        for j, p in enumerate(phases):
            s = r["phases_s"].get(p) or {}
            v = s.get("median") or 0.0
            ax.barh([i], [v], left=left, color=f"C{j % 10}", label=p if i == 0 else None)
            if v >= 0.6:
                ax.text(left + v / 2, i, f"{v:.1f}", ha="center", va="center", fontsize=7, color="white")
            left += v
        total = (r.get("to_first_dispatch_s") or {}).get("median")
        if total is not None:
            ax.text(left, i, f"  {total:.1f}s", va="center", fontsize=8)
    goal = res["goal"].get("relaunch_to_first_dispatch_max_s")
    if goal:
        ax.axvline(goal, color="red", linestyle=":", label=f"goal: relaunch ≤ {goal:g}s")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{r['label']}\n({r['runs']} run{'s' if r['runs'] != 1 else ''})" for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from process start (medians per phase)")
    ax.set_title("Launch to the first dispatched rollout, by phase (startup.json)", fontsize=10)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


PLOTTERS = {"snapshot_cost": snapshot_cost, "stall": stall, "work_lost": work_lost, "alternative": alternative,
            "overhead": overhead, "setup_check": setup_check, "relaunch": relaunch}


def plot(name: str, res: dict[str, Any], out_dir: Path) -> Path:
    return PLOTTERS[name](res, Path(out_dir) / f"{name}.png")
