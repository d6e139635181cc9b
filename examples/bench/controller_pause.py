"""Micro-benchmark: the controller's own work in a staged snapshot, at N rollouts in flight: what the
pause does, and what runs after resume on the copies it took.

    python examples/bench/controller_pause.py 512 2048 8192 16384          # table, median of --repeats
    python examples/bench/controller_pause.py 8192 --changed 0.02 --repeats 9

One process, no Gym, no I/O: a real ``RolloutRecoveryLedger`` with N turn-level rollouts dispatched
(N / 16 prompt groups x 16 generations, on one Gym instance, the shape of measurement 1b), and the
very functions a staged snapshot runs (``rollout_snapshot/stagers.py``, ``planner.py``). Gym's answer
is stood in for by the list of captured keys a prepare reply carries.

- **before the attempt** (gate open, nothing held): the ledger's pause views brought up to date
  (``refresh_pause_views``: each changed group's JSON and held rollouts);
- **in the pause**: the plan (``plan_snapshot``: the commit scope), what the drain waits for
  (``drain_wait``, from the runs the agents answered lately; stood in for by the rollouts that sealed
  since the last snapshot), the copy of what the ledger expects Gym to hold (``gym_checkpoint_keys``)
  and the ledger's JSON (``state_json_parts``: each group's bytes by reference, joined after resume);
- **after resume** (docs/design.md §5.4), on those copies: Gym's answer (the agents' captured keys within
  the scope, and what restarts from the prompt: ``unstarted_after_drain``), the ownership check
  (``check_ownership``), the counts (``count_snapshot``) and the per-server scopes persist writes
  (``server_scopes``).

``first`` is the first pause over a ledger (its pause views computed for every group); ``steady`` the
pause after ``--changed`` of the rollouts moved since the previous one (each sealed, and a new group
reserved and dispatched in its place): the state between two snapshots.

Times are CPU ms (``time.thread_time``, GC frozen), median of ``--repeats``; the load average is printed
with the table (run it on a quiet machine).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.planner import (  # noqa: E402
    FirstCounts,
    check_ownership,
    count_snapshot,
    gym_checkpoint_keys,
    plan_snapshot,
    server_scopes,
)
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.stagers import (  # noqa: E402
    drain_wait,
    unstarted_after_drain,
)
from nemo_rl.experience.rollout_recovery import RolloutRecoveryLedger  # noqa: E402

IID = "nemo_gym/replica-0"
GENERATIONS = 16
AGENT_SERVERS = {IID: {"workplace_simple_agent": ["workplace_simple_agent", "policy_model", "workplace_assistant"]}}
PARTS = ("views", "plan", "drain_wait", "held_copy", "ledger_json", "pause", "gym_answer", "ownership_counts",
         "server_scopes", "after")


class Flight:
    """A ledger with ``n`` rollouts in flight, and the moves between two snapshots."""

    def __init__(self, n: int):
        self.ledger = RolloutRecoveryLedger()
        self.next_group = 0
        for _ in range(n // GENERATIONS):
            self._new_group()
        self.first = FirstCounts()
        self.answered: set[str] = set()  # the rollouts sealed since the last pause: what the agents answered lately

    def _new_group(self) -> None:
        i = self.next_group
        self.next_group += 1
        self.ledger.reserve_group(f"s1p{i}", f"p{i}", i, "workplace", "workplace_simple_agent", "turn",
                                  GENERATIONS, 1, position=i)
        for req in self.ledger.reserved_attempts():
            self.ledger.mark_dispatched(req.rollout_id, IID, weight_version=0)

    def move(self, share: float) -> None:
        """``share`` of the rollouts finish: whole groups seal, are trained and compacted, and as many
        new groups are dispatched in their place."""
        groups = max(1, round(share * len(self.ledger.groups)))
        for group_id in list(self.ledger.groups)[:groups]:
            group = self.ledger.groups[group_id]
            for sibling in group.siblings:
                key = group.rollout_id(sibling.generation_index)
                self.ledger.mark_sealed(key, 1.0)
                self.answered.add(key)
            self.ledger.mark_group_trained(group_id)
            self.ledger.compact_trained([group_id])
        for _ in range(groups):
            self._new_group()

    def pause(self) -> dict[str, float]:
        """One staged snapshot's controller work, each part timed; every in-scope rollout counts as captured."""
        ledger, clock = self.ledger, time.thread_time
        b0 = clock()
        ledger.refresh_pause_views()  # before the attempt: nothing held
        b1 = clock()
        captured = list(ledger.turn_level_held().get(IID, ()))  # a prepare reply's ``captured`` (a list)
        c0 = clock()
        plan = plan_snapshot(ledger, [IID], {IID: ()})
        c1 = clock()
        waited = drain_wait(plan.scope, {IID: self.answered}, lambda iid: set())
        c2 = clock()
        held = gym_checkpoint_keys(ledger, plan.topology)
        refused = len(ledger.refused_waiting())
        c3 = clock()
        data = ledger.state_json_parts()  # joined after resume (``ControllerStateCapture.write``)
        c4 = clock()
        exported = {IID: set().union(captured) & plan.scope_keys[IID]}  # as ``exported_keys``
        not_started = unstarted_after_drain(plan.scope_keys, exported, waited, {}, {})
        c5 = clock()
        owned = check_ownership(plan, exported, not_started, held=held)
        counts = count_snapshot(plan, exported, not_started, owned=owned, first=self.first,
                                refused_waiting=refused)
        c6 = clock()
        server_scopes(plan, AGENT_SERVERS)
        c7 = clock()
        assert counts.saved == len(plan.scope[IID]) and data and not waited and not not_started[IID]
        counts.keys.settle()  # once the snapshot commits
        self.answered = set()
        t = dict(views=b1 - b0, plan=c1 - c0, drain_wait=c2 - c1, held_copy=c3 - c2, ledger_json=c4 - c3,
                 pause=c4 - c0, gym_answer=c5 - c4, ownership_counts=c6 - c5, server_scopes=c7 - c6, after=c7 - c4)
        return {k: v * 1e3 for k, v in t.items()}


def measure(n: int, repeats: int, changed: float) -> dict[str, dict[str, float]]:
    firsts, steadies = [], []
    for _ in range(repeats):
        flight = Flight(n)
        gc.collect()
        gc.freeze()
        try:
            firsts.append(flight.pause())
            flight.move(changed)
            steadies.append(flight.pause())
        finally:
            gc.unfreeze()
    return {"first": _median(firsts), "steady": _median(steadies)}


def _median(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sizes", nargs="*", type=int, default=[512, 2048, 8192])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--changed", type=float, default=0.02, help="share of rollouts moved between two pauses")
    args = ap.parse_args(argv)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("| N | ledger | before the attempt: views | in the pause: plan | drain wait | held copy | ledger JSON | "
          "**pause total** | after resume: Gym's answer | ownership + counts | server scopes | after total |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n in args.sizes:
        res = measure(n, args.repeats, args.changed)
        for kind in ("first", "steady"):
            r = res[kind]
            label = kind if kind == "first" else f"steady ({args.changed:.0%} moved)"
            print(f"| {n:,} | {label} | " + " | ".join(
                f"**{r[k]:.2f}**" if k == "pause" else f"{r[k]:.2f}" for k in PARTS) + " |")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
