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


def snapshot_cost(res: dict[str, Any], path: Path) -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    styles = {"disk": "-", "tmpfs": "--"}
    for storage in res["config"]["storages"]:
        rows = [r for r in res["rows"] if r["storage"] == storage]
        ns = [r["n"] for r in rows]
        for field, color in (("pause_s", "C0"), ("prepare_s", "C1"), ("commit_s", "C2"), ("publish_s", "C3")):
            meds = [r[field]["median"] * 1e3 for r in rows]
            errs = [[r[field]["median"] * 1e3 - r[field]["min"] * 1e3 for r in rows],
                    [r[field]["max"] * 1e3 - r[field]["median"] * 1e3 for r in rows]]
            axes[0].errorbar(ns, meds, yerr=errs, fmt="o" + styles.get(storage, "-"), color=color, capsize=3,
                             label=f"{field[:-2]} ({storage})")
        excess = [r["excess_s"]["median"] * 1e3 for r in rows]
        errs = [[r["excess_s"]["median"] * 1e3 - r["excess_s"]["min"] * 1e3 for r in rows],
                [r["excess_s"]["max"] * 1e3 - r["excess_s"]["median"] * 1e3 for r in rows]]
        axes[1].errorbar(ns, excess, yerr=errs, fmt="o" + styles.get(storage, "-"), capsize=3,
                         label=f"pause − tool time left ({storage})")
    disk = [r for r in res["rows"] if r["storage"] == res["config"]["storages"][0]]
    axes[2].plot([r["n"] for r in disk], [r["bytes"]["median"] / 1e6 for r in disk], "o-", color="C4")
    goal = res["goal"].get("pause_within_ms_of_longest_tool")
    if goal:
        axes[1].axhline(goal, color="red", linestyle=":", label=f"goal: {goal:g} ms")
    for ax, title, ylabel in ((axes[0], "Snapshot pause and its parts (no tool in flight)", "ms"),
                              (axes[1], f"Pause beyond a {res['config']['tool_s']:g}s tool call in flight", "ms"),
                              (axes[2], "Bytes written per snapshot", "MB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("rollouts in flight (N)")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7, ncol=2)
    axes[1].legend(fontsize=7)
    fig.suptitle("Snapshot cost versus rollouts in flight (median, bars: min–max)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def stall(res: dict[str, Any], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    rows = res["rows"]
    meds = _bars(ax, [r["policy"] for r in rows], [r["time_per_attempt_s"] for r in rows], color=["C3", "C2"])
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
    labels = {"none": "no snapshots", "best_effort": "best effort", "alternative": "retire blockers\n+ prepare again"}
    rows = res["rows"]
    _bars(ax, [labels[r["mode"]] for r in rows], [r["rollouts_per_min"] for r in rows], color=["C7", "C2", "C3"])
    ax.set_ylabel("rollouts completed per minute")
    ax.set_title(f"Restart-only agent, snapshot every {res['config']['interval_s']:g}s "
                 f"(rollout ≈ {res['config']['rollout_s_median']:.2f}s)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def overhead(res: dict[str, Any], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    rows = res["rows"]
    labels = ["none" if r["mode"] == "none" else
              f"every {r['turns']:g} turns\n({r['interval_s']:.1f}s{', ' + r['storage'] if r['storage'] != 'disk' else ''})"
              for r in rows]
    meds = _bars(ax, labels, [r["rollouts_per_min"] for r in rows], color=["C7", "C0", "C1", "C2", "C3"][: len(rows)])
    for i, r in enumerate(rows):
        if r["mode"] != "none":
            ax.text(i, meds[i], f"{r['overhead_pct']['median']:+.1f}%", ha="center", va="bottom")
    ax.set_ylabel("rollouts completed per minute")
    ax.set_title("Throughput with periodic snapshots (Workplace, every server saves)", fontsize=10)
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


PLOTTERS = {"snapshot_cost": snapshot_cost, "stall": stall, "work_lost": work_lost, "alternative": alternative,
            "overhead": overhead, "setup_check": setup_check}


def plot(name: str, res: dict[str, Any], out_dir: Path) -> Path:
    return PLOTTERS[name](res, Path(out_dir) / f"{name}.png")
