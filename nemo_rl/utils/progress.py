"""A progress bar for training steps: step, reward and snapshot counts."""

from __future__ import annotations

from typing import Any

from tqdm import tqdm


class StepProgress:
    def __init__(self, total: int, enabled: bool = True):
        self.total, self.enabled = total, enabled
        self._bar: tqdm | None = None

    def __enter__(self) -> "StepProgress":
        # tqdm falls back to periodic lines when stderr is not a terminal (CI logs).
        self._bar = tqdm(total=self.total, desc="GRPO", unit="step", disable=not self.enabled,
                         mininterval=0 if self.enabled else 1e9, dynamic_ncols=True)
        return self

    def update(self, record: dict[str, Any]) -> None:
        if self._bar is None:
            return
        self._bar.n = record["step"]
        self._bar.set_postfix(
            reward=f"{record.get('reward_mean', 0.0):.2f}",
            snaps=record.get("snapshots_committed", 0),
            failed=record.get("snapshots_failed", 0),
            refresh=False,
        )
        self._bar.refresh()
        if not self._bar.disable and not self._bar.fp.isatty():
            print(
                f"step {record['step']}/{self.total} reward {record.get('reward_mean', 0.0):.3f} "
                f"snapshots {record.get('snapshots_committed', 0)} committed / {record.get('snapshots_failed', 0)} failed",
                flush=True,
            )

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.close()
