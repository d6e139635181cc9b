"""The reward curve PNG and the final summary table of a run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def plot_run(metrics: list[dict[str, Any]], path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics]
    rewards = [m.get("reward_mean", 0.0) for m in metrics]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, rewards, marker="o", label="mean reward")
    if len(rewards) >= 3:
        k = 3
        smooth = [sum(rewards[max(0, i - k + 1): i + 1]) / len(rewards[max(0, i - k + 1): i + 1]) for i in range(len(rewards))]
        ax.plot(steps, smooth, label=f"moving mean ({k})")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def summary_table(metrics: list[dict[str, Any]], log_dir: str | Path) -> str:
    log_dir = Path(log_dir)
    snaps = []
    if (log_dir / "snapshots.jsonl").exists():
        snaps = [json.loads(x) for x in (log_dir / "snapshots.jsonl").read_text().splitlines() if x.strip()]
    n = len(metrics)
    fifth = max(1, n // 5)
    first = sum(m.get("reward_mean", 0.0) for m in metrics[:fifth]) / fifth if n else 0.0
    last = sum(m.get("reward_mean", 0.0) for m in metrics[-fifth:]) / fifth if n else 0.0
    committed = [s for s in snaps if s.get("committed")]
    rows = [
        ("steps trained", str(n)),
        ("reward, first fifth of steps", f"{first:.3f}"),
        ("reward, last fifth of steps", f"{last:.3f}"),
        ("snapshots committed / attempted", f"{len(committed)} / {len(snaps)}"),
        ("rollouts saved at turn level (sum)", str(sum(s.get("saved", 0) for s in committed))),
        ("rollouts unsaved (sum)", str(sum(s.get("unsaved", 0) for s in committed))),
        ("generation s (total)", f"{sum(m.get('generation_s', 0.0) for m in metrics):.1f}"),
        ("training s (total)", f"{sum(m.get('training_s', 0.0) for m in metrics):.1f}"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = ["| " + "what".ljust(width) + " | value |", "|" + "-" * (width + 2) + "|-------|"]
    lines += [f"| {k.ljust(width)} | {v} |" for k, v in rows]
    return "\n".join(lines)
