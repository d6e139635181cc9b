"""The reward curve PNG and the final summary table of a run."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from nemo_rl.utils.jsonl_rows import read_rows
from nemo_rl.utils.recovery_record import RecoveryRecord, read_recoveries


def plot_run(metrics: list[dict[str, Any]], path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    validation = [(m["step"], m["val_reward_mean"]) for m in metrics if m.get("val_reward_mean") is not None]
    metrics = training_records(metrics)
    steps = [m["step"] for m in metrics]
    rewards = [m.get("reward_mean", 0.0) for m in metrics]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, rewards, marker="o", label="mean reward (train rollouts)")
    if validation:
        ax.plot(*zip(*validation), marker="s", linestyle="--", color="tab:green", label="validation reward")
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


def training_records(metrics: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-step training records (a validation-at-start record has no ``reward_mean``)."""
    return [m for m in metrics if "reward_mean" in m]


def no_reward_signal(metrics: list[dict[str, Any]]) -> bool:
    """Every trained step had advantage 0 everywhere (each group's rewards equal): GRPO learned nothing."""
    steps = [m for m in training_records(metrics) if "advantage_abs_mean" in m]
    return bool(steps) and all(m["advantage_abs_mean"] == 0 for m in steps)


def _distinct(committed: list[dict[str, Any]], key: str) -> str:
    """The committed snapshots' first counts added up: each rollout once (docs/design.md §5.4). Rows
    written before ``new_saved`` existed have no first count and are said to be left out."""
    counted = [s for s in committed if key in s]
    total = str(sum(s[key] for s in counted))
    older = len(committed) - len(counted)
    return total if not older else f"{total} (+ {older} older snapshot(s) that did not record it)"


def _recovery_rows(recoveries: list[RecoveryRecord]) -> list[tuple[str, str]]:
    """The table's row for in-run recoveries (none: no row), with the last three."""
    if not recoveries:
        return []
    last = ", ".join(f"{r.what} {r.action}" for r in recoveries[-3:])
    return [("in-run recoveries (recoveries.jsonl)", f"{len(recoveries)}: {last}")]


def _replay_rows(metrics: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The table's row for rollouts that came back by replay (docs/design.md §4.8), none without any."""
    rollouts = sum(m.get("replay_rollouts", 0) for m in metrics)
    if not rollouts:
        return []
    replayed = sum(m.get("replay_calls_replayed", 0) for m in metrics)
    live = sum(m.get("replay_calls_live_after_divergence", 0) for m in metrics)
    sites = [d for m in metrics for d in m.get("replay_divergence_sites", [])]
    where = ", ".join(f"{d['server']} at call {d['call']}" for d in sites[-3:])
    return [("rollouts continued by replay: calls replayed, live after a divergence",
             f"{rollouts}: {replayed} replayed, {live} live after {len(sites)} divergence(s)"
             + (f" ({where})" if where else ""))]


def summary_table(metrics: list[dict[str, Any]], log_dir: str | Path, *, wall_s: float | None = None,
                  checkpoint_dir: str | Path | None = None) -> str:
    """The end-of-run table: steps, reward, snapshots, coverage, time and where the run wrote."""
    validation = [m for m in metrics if m.get("val_reward_mean") is not None]
    metrics = training_records(metrics)
    log_dir = Path(log_dir)
    snaps = read_rows(log_dir / "snapshots.jsonl")
    n = len(metrics)
    fifth = max(1, n // 5)
    first = sum(m.get("reward_mean", 0.0) for m in metrics[:fifth]) / fifth if n else 0.0
    last = sum(m.get("reward_mean", 0.0) for m in metrics[-fifth:]) / fifth if n else 0.0
    committed = [s for s in snaps if s.get("committed")]
    recoveries = read_recoveries(log_dir / "recoveries.jsonl")
    rows = [
        ("steps trained", str(n)),
        ("reward, first fifth of steps", f"{first:.3f}"),
        ("reward, last fifth of steps", f"{last:.3f}"),
        ("snapshots committed / attempted", f"{len(committed)} / {len(snaps)}"),
        ("rollouts saved at turn level (distinct)", _distinct(committed, "new_saved")),
        ("rollouts unsaved on restart-only servers (distinct)", _distinct(committed, "new_unsaved")),
        ("rollout saves, all snapshots (one per rollout per snapshot)", str(sum(s.get("saved", 0) for s in committed))),
        *_recovery_rows(recoveries),
        *_replay_rows(metrics),
        *([("validation reward, first -> last", f"{validation[0]['val_reward_mean']:.3f} (step "
            f"{validation[0]['step']}) -> {validation[-1]['val_reward_mean']:.3f} (step {validation[-1]['step']})")]
          if validation else []),
        ("generation s (total)", f"{sum(m.get('generation_s', 0.0) for m in metrics):.1f}"),
        ("training s (total)", f"{sum(m.get('training_s', 0.0) for m in metrics):.1f}"),
        *([("snapshot coverage (share of wall time)", f"{metrics[-1]['snapshot_coverage']:.3f}")]
          if metrics and metrics[-1].get("snapshot_coverage") is not None else []),
        *([("wall time s (this start)", f"{wall_s:.1f}")] if wall_s is not None else []),
        ("log dir", str(log_dir)),
        *([("checkpoint dir", str(checkpoint_dir))] if checkpoint_dir is not None else []),
    ]
    width = max(len(k) for k, _ in rows)
    lines = ["| " + "what".ljust(width) + " | value |", "|" + "-" * (width + 2) + "|-------|"]
    lines += [f"| {k.ljust(width)} | {v} |" for k, v in rows]
    return "\n".join(lines)
