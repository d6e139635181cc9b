"""The in-run recovery's per-step metrics (docs/design.md §5.12), named in the style of upstream NeMo-RL's
supervisor and generation-fleet metrics, so dashboards built for upstream read them too (listed in
docs/usage.md). Counts are cumulative over the start; the rollouts and seconds are of the recoveries whose
row was written during the step."""

from __future__ import annotations

import collections

from nemo_rl.algorithms.single_controller_utils.recovery.records import RecoveryRecord


class RecoveryMetrics:
    """Counts what the supervisor did; ``take`` hands out one step's fields."""

    def __init__(self) -> None:
        self.counters: collections.Counter[str] = collections.Counter()
        self.by_kind: collections.Counter[str] = collections.Counter()  # recoveries started, by part kind
        self._step: list[tuple[str, RecoveryRecord]] = []  # rows written since the last ``take``

    def started(self, kind: str) -> None:
        self.counters["supervisor/restarts_started"] += 1
        self.by_kind[kind] += 1

    def attempt(self, kind: str) -> None:
        self.counters[f"supervisor/start_attempts/{kind}"] += 1

    def succeeded(self, kind: str, action: str) -> None:
        self.counters["supervisor/restarts_succeeded"] += 1
        self.counters[f"supervisor/recoveries/{kind}/{action}"] += 1

    def failed(self, kind: str) -> None:
        self.counters["supervisor/restarts_failed"] += 1
        self.counters[f"supervisor/recoveries/{kind}/failed"] += 1

    def row(self, kind: str, record: RecoveryRecord) -> None:
        self._step.append((kind, record))

    def take(self, in_flight: set[str]) -> dict[str, float]:
        """This step's fields: the cumulative counts, the recoveries under way now, and what the rows written
        during the step say (rollouts continued and sent back to their prompt, calls sent again, and the mean
        seconds from a loss to its first re-dispatch)."""
        out: dict[str, float] = {key: float(n) for key, n in sorted(self.counters.items())}
        for key in ("supervisor/restarts_started", "supervisor/restarts_succeeded", "supervisor/restarts_failed"):
            out.setdefault(key, 0.0)
        out["supervisor/restarts_in_flight"] = float(len(in_flight))
        rows, self._step = self._step, []
        if rows:
            out["supervisor/rows"] = float(len(rows))
            out["supervisor/rollouts_continued"] = float(sum(
                len(r.continued_turn) + len(r.continued_prefix) + len(r.continued_replay) for _, r in rows))
            out["supervisor/rollouts_restarted_from_prompt"] = float(sum(len(r.restarted_from_prompt)
                                                                         for _, r in rows))
            out["supervisor/calls_resent"] = float(sum(r.calls_resent for _, r in rows))
            timed = [r.seconds_to_redispatch for _, r in rows if r.seconds_to_redispatch is not None]
            if timed:
                out["supervisor/seconds_to_redispatch"] = sum(timed) / len(timed)
        return out
