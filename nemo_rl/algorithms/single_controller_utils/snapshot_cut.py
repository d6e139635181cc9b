"""The bookkeeping of one rollout snapshot, as pure functions of the ledger and Gym's answers.

A snapshot spans every Gym instance (``<shard>/replica-<i>``) at once. These
functions hold no I/O, so the snapshotter and the model-based tests run the
very same code:

- ``plan_cut``: after prepare, what each instance is asked to commit (its
  turn-level rollouts minus those Gym reported unsaved);
- ``check_cut``: after commit and drain, under the exclusive cut, every
  rollout the ledger still expects Gym to hold was either exported or reported
  unsaved (else ``GymOwnershipError``);
- ``cut_counts``: what the run record says about the cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from gym_patches.checkpoint.identity import EpisodeId
from nemo_rl.experience.rollout_recovery import RolloutRecoveryLedger


class GymOwnershipError(RuntimeError):
    """Gym and the ledger disagree about who holds a rollout: a bug, never retried."""


@dataclass(frozen=True)
class CutPlan:
    """What one snapshot asks of Gym, per instance."""

    instance_ids: tuple[str, ...]
    scope: dict[str, list[EpisodeId]]  # committed per instance
    unsaved: dict[str, frozenset[str]]  # keys Gym said it cannot save (restart-only servers)


@dataclass(frozen=True)
class CutCounts:
    """Turn-level rollouts of the cut: saved by Gym, on restart-only servers, refused by Gym and waiting."""

    saved: int
    unsaved: int
    not_admitted: int


def plan_cut(
    ledger: RolloutRecoveryLedger,
    instance_ids: Iterable[str],
    gym_unsaved: Mapping[str, Iterable[str]],
) -> CutPlan:
    """The commit scope of every instance, from one inventory of the whole ledger."""
    iids = tuple(sorted(instance_ids))
    unsaved = {iid: frozenset(gym_unsaved.get(iid, ())) for iid in iids}
    inventory = ledger.gym_checkpoint_inventory(iids)
    scope = {iid: [e for e in inventory[iid] if e.capture_key not in unsaved[iid]] for iid in iids}
    return CutPlan(iids, scope, unsaved)


def server_scopes(
    ledger: RolloutRecoveryLedger, plan: CutPlan, agent_servers: Mapping[str, Mapping[str, list[str]]]
) -> dict[str, dict[str, list[EpisodeId]]]:
    """Per instance, per Gym server: only the episodes that server takes part in.

    ``agent_servers[instance][agent]`` lists the servers an agent's rollouts
    touch (the agent, its model server, its resources server); a server no
    episode touches gets an empty scope and exports nothing.
    """
    out: dict[str, dict[str, list[EpisodeId]]] = {}
    for iid in plan.instance_ids:
        servers_of = agent_servers.get(iid, {})
        by_server: dict[str, list[EpisodeId]] = {}
        for episode in plan.scope[iid]:
            agent = ledger.agent_of(episode)
            if agent not in servers_of:
                raise GymOwnershipError(
                    f"rollout {episode.capture_key} on Gym instance {iid} belongs to agent {agent!r}, "
                    f"which that instance does not serve (agents: {sorted(servers_of)})"
                )
            for server in servers_of[agent]:
                by_server.setdefault(server, []).append(episode)
        out[iid] = by_server
    return out


def check_cut(
    ledger: RolloutRecoveryLedger,
    plan: CutPlan,
    exported: Mapping[str, Iterable[str]],
    not_started: Mapping[str, Iterable[str]] | None = None,
) -> None:
    """On every instance: nothing exported outside the scope; owned minus exported is unsaved.

    ``not_started``: in-scope rollouts Gym holds but has not started (a ``/run`` that reached a
    saving agent after it closed, or one the drain did not see finish): they restart from the
    prompt after a crash, like unsaved ones, having lost nothing."""
    problems = []
    owned_by = ledger.gym_checkpoint_keys(plan.instance_ids)
    for iid in plan.instance_ids:
        done = set(exported.get(iid, ()))
        outside = done - {e.capture_key for e in plan.scope[iid]}
        if outside:
            problems.append(f"Gym instance {iid} exported rollouts outside its commit scope: {sorted(outside)[:10]}")
        stray = owned_by[iid] - done - plan.unsaved[iid] - set((not_started or {}).get(iid, ()))
        if stray:
            problems.append(
                f"Gym instance {iid}: rollouts owned by the ledger were neither saved nor reported unsaved "
                f"by Gym: {sorted(stray)[:10]}"
            )
    if problems:
        raise GymOwnershipError("; ".join(problems))


def cut_counts(
    ledger: RolloutRecoveryLedger,
    plan: CutPlan,
    exported: Mapping[str, Iterable[str]],
    not_started: Mapping[str, Iterable[str]] | None = None,
) -> CutCounts:
    """Counts at the cut (call it under the exclusive cut, where ``check_cut`` passed).

    ``unsaved``: on restart-only servers; ``not_admitted``: refused by Gym, or held there unstarted."""
    inventory = ledger.gym_checkpoint_keys(plan.instance_ids)
    saved = unsaved = waiting = 0
    for iid in plan.instance_ids:
        done = set(exported.get(iid, ()))
        idle = set((not_started or {}).get(iid, ()))
        for key in inventory[iid]:
            if key in done:
                saved += 1
            elif key in idle:
                waiting += 1
            elif key in plan.unsaved[iid]:
                unsaved += 1
    return CutCounts(saved, unsaved, waiting + len(ledger.refused_waiting()))
