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


def async_throughput(res: dict[str, Any], path: Path) -> Path:
    """Steps per hour and coverage, sync against async, per snapshot setting; the reward curves of part 2."""
    rows = res["rows"]
    keys = list(dict.fromkeys(r["snapshots"] for r in rows))
    label = {k: "snapshots off" if k == "off" else f"snapshots every {k[:-1]} s" for k in keys}
    learning = res.get("learning") or []
    fig, axes = plt.subplots(1, 3 if learning else 2, figsize=(16 if learning else 11, 4.6))
    width = 0.38
    for mi, (mode, color) in enumerate((("sync", "C7"), ("async", "C0"))):
        xs = [i + (mi - 0.5) * width for i in range(len(keys))]
        for ax, field, scale in ((axes[0], "steps_per_hour", 1.0), (axes[1], "coverage", 100.0)):
            stats = [next((r[field] for r in rows if r["mode"] == mode and r["snapshots"] == k), None) for k in keys]
            meds = [s["median"] * scale if s and s.get("median") is not None else 0.0 for s in stats]
            errs = [[m - s["min"] * scale if s and s.get("n") else 0.0 for m, s in zip(meds, stats)],
                    [s["max"] * scale - m if s and s.get("n") else 0.0 for m, s in zip(meds, stats)]]
            ax.bar(xs, meds, width, yerr=errs, capsize=3, color=color, label=mode)
            for x, m, k in zip(xs, [m + hi for m, hi in zip(meds, errs[1])], keys):  # above the error bar
                row = next((r for r in rows if r["mode"] == mode and r["snapshots"] == k), None)
                if field == "steps_per_hour" and row:
                    bits = []
                    if row.get("speedup_vs_sync") and row["speedup_vs_sync"].get("n"):
                        bits.append(f"x{row['speedup_vs_sync']['median']:.2f}")
                    if row.get("overhead_pct") and row["overhead_pct"].get("n"):
                        bits.append(f"{row['overhead_pct']['median']:+.1f}%")
                    if bits:
                        ax.text(x, m, "\n".join(bits), ha="center", va="bottom", fontsize=7)
                elif field == "coverage" and row:
                    ax.text(x, m, f"{row['coverage']['median'] * 100:.1f}", ha="center", va="bottom", fontsize=7)
    goal = res["goal"].get("coverage_min")
    if goal:
        axes[1].axhline(goal * 100, color="red", linestyle=":", label=f"goal (async): {goal * 100:g}%")
    for ax, title, ylabel in ((axes[0], "Steps per hour, steps 2–N (labels: async / sync, overhead vs off)",
                               "steps per hour"),
                              (axes[1], "Snapshot coverage of wall time (last row)", "% of wall time")):
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels([label[k] for k in keys], fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(True, axis="y", alpha=0.3)
    if learning:
        ax = axes[2]
        for w, color in zip(learning, ("C7", "C0")):
            rewards = w["rewards"]
            k = max(1, w.get("fifth") or 1)
            smooth = [sum(rewards[max(0, i - k + 1): i + 1]) / len(rewards[max(0, i - k + 1): i + 1])
                      for i in range(len(rewards))]
            ax.plot(range(1, len(rewards) + 1), rewards, color=color, alpha=0.3)
            ax.plot(range(1, len(rewards) + 1), smooth, color=color,
                    label=f"{w['mode']}: {w['reward_first_fifth']:.2f} → {w['reward_last_fifth']:.2f} "
                          f"({w['wall_s']:.0f} s)")
        ax.set_xlabel("step")
        ax.set_ylabel("reward mean")
        ax.set_title("Main job reward per step (line: mean over a fifth of the steps)", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
    fig.suptitle("Async (lookahead 1) against sync on the main job (median, bars: min–max)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def prefix_work_lost(res: dict[str, Any], path: Path) -> Path:
    """Regenerated tokens per restored call, prefix against turn, per crash (with one interval's tokens); and
    what the cut adds to the pause against what it costs after resume, per calls in flight."""
    crashes, pauses = res["crashes"], res["pauses"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.38
    xs = range(len(crashes))
    for off, key, color, label in ((-0.5, "lost_turn", "C7", "turn"), (0.5, "lost_prefix", "C0", "prefix")):
        meds = [sorted(c[key])[len(c[key]) // 2] for c in crashes]
        lows = [m - min(c[key]) for m, c in zip(meds, crashes)]
        highs = [max(c[key]) - m for m, c in zip(meds, crashes)]
        ax1.bar([x + off * width for x in xs], meds, width, yerr=[lows, highs], capsize=3, color=color, label=label)
    ax1.scatter([x + 0.5 * width for x in xs], [c["interval_tokens"] for c in crashes], marker="_", s=400,
                color="red", label="tokens one call decodes in one interval (prefix goal)", zorder=3)
    ax1.set_xticks(list(xs))
    ax1.set_xticklabels([f"crash {i + 1}" for i in xs])
    ax1.set_ylabel("regenerated tokens per restored call")
    ax1.set_title(f"{res['config']['calls']} calls of {res['config']['max_tokens']} tokens, a snapshot every "
                  f"{res['config']['interval_s']:g} s", fontsize=9)
    ax1.legend(fontsize=7)
    ax1.grid(True, axis="y", alpha=0.3)
    labels = [str(p["calls"]) for p in pauses]
    _bars(ax2, labels, [p["cut_ms"] for p in pauses], color="C0")
    ax2.axhline(5.0, color="red", linestyle=":", label="goal: 5 ms added to the pause")
    for i, p in enumerate(pauses):
        ax2.text(i, p["cut_ms"]["max"], f"{p['cut_ms']['median']:.2f} ms\n(pin + fetch after resume: "
                 f"{p['fetch_ms']['median']:.0f} ms)", ha="center", va="bottom", fontsize=7)
    ax2.set_xlabel("calls in flight")
    ax2.set_ylabel("ms added to the pause")
    ax2.set_title("What the cut adds to the pause", fontsize=9)
    ax2.legend(fontsize=7)
    ax2.grid(True, axis="y", alpha=0.3)
    fig.suptitle("Prefix-level recovery: work lost per crash and the cut's cost (median, bars: min–max)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def preemption(res: dict[str, Any], path: Path) -> Path:
    """Finished turns regenerated per in-flight rollout, before (SIGKILL) against the final snapshot (SIGTERM),
    per snapshot interval; and seconds from SIGTERM to the final snapshot's row and to exit, per N in flight."""
    from bench.preemption import BEFORE, FINAL

    rows, exits = res["rows"], res["exit_rows"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.4))
    intervals = sorted({r["interval_s"] for r in rows})
    width = 0.38
    for off, behaviour, color in ((-0.5, BEFORE, "C7"), (0.5, FINAL, "C0")):
        stats = [next((r["lost_calls_per_in_flight"] for r in rows
                       if r["interval_s"] == i and r["behaviour"] == behaviour), None) for i in intervals]
        meds = [s["median"] if s and s.get("median") is not None else 0.0 for s in stats]
        lows = [m - s["min"] if s and s.get("median") is not None else 0.0 for m, s in zip(meds, stats)]
        highs = [s["max"] - m if s and s.get("median") is not None else 0.0 for m, s in zip(meds, stats)]
        label = "before: SIGKILL (newest periodic snapshot)" if behaviour == BEFORE else "SIGTERM: final snapshot"
        xs = [x + off * width for x in range(len(intervals))]
        ax1.bar(xs, meds, width, yerr=[lows, highs], capsize=3, color=color, label=label)
        for x, m, s in zip(xs, meds, stats):
            if s and s.get("median") is not None:
                ax1.text(x, m, f"{m:.2f}", ha="center", va="bottom", fontsize=7)
    ax1.set_xticks(list(range(len(intervals))))
    ax1.set_xticklabels([f"snapshot every {i:g} s" for i in intervals])
    ax1.set_ylabel("finished turns regenerated per in-flight rollout")
    ax1.set_title("Work lost per preemption (model calls finished before the stop, redone)", fontsize=9)
    ax1.legend(fontsize=7)
    ax1.grid(True, axis="y", alpha=0.3)
    measured = [r for r in exits if r["exit_s"]["n"]]
    labels = [f"{r['n']:,}" for r in measured]
    if measured:
        _bars(ax2, labels, [r["exit_s"] for r in measured], color="C0")
        for i, r in enumerate(measured):
            if r["final_row_s"]["n"]:
                ax2.scatter([i], [r["final_row_s"]["median"]], marker="_", s=500, color="C3", zorder=3,
                            label="signal → final snapshot row" if i == 0 else None)
        ax2.axhline(res["goal"].get("grace_s", 25.0), color="red", linestyle=":", label="stop_grace_s (default)")
        ax2.legend(fontsize=7)
    ax2.set_xlabel("rollouts in flight at the SIGTERM")
    ax2.set_ylabel("seconds from SIGTERM to the driver's exit")
    ax2.set_title("SIGTERM to exit (one replica, periodic snapshots off)", fontsize=9)
    ax2.grid(True, axis="y", alpha=0.3)
    fig.suptitle("Preemption (median, bars: min–max)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


PLOTTERS = {"snapshot_cost": snapshot_cost, "stall": stall, "work_lost": work_lost, "alternative": alternative,
            "overhead": overhead, "setup_check": setup_check, "relaunch": relaunch,
            "async_throughput": async_throughput, "prefix_work_lost": prefix_work_lost, "preemption": preemption}


def plot(name: str, res: dict[str, Any], out_dir: Path) -> Path:
    return PLOTTERS[name](res, Path(out_dir) / f"{name}.png")
