"""The bookkeeping of one rollout snapshot, as pure functions of the ledger and Gym's answers.

A snapshot spans every Gym instance (``<shard>/replica-<i>``) at once. These
functions hold no I/O, so the snapshotter and the model-based tests run the
very same code:

- ``gym_checkpoint_agents`` (and ``gym_checkpoint_keys``,
  ``gym_checkpoint_inventory``): the ledger's turn-level rollouts per
  instance, what a snapshot is planned and checked against;
- ``plan_snapshot``: after prepare, what each instance is asked to commit (its
  turn-level rollouts minus those Gym reported unsaved), and ``server_scopes``
  splits that per Gym server;
- ``check_ownership``: after commit and drain, every rollout the ledger
  expected Gym to hold when the pause captured its state was either exported
  or reported unsaved (else ``GymOwnershipError``); a snapshotter runs it after
  resume on the references its pause kept to the ledger's persistent views
  (``held=``), before anything is published;
- ``count_snapshot``: what the run record says about the snapshot, and (with
  ``FirstCounts``) which of its rollouts no earlier snapshot had counted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Collection, Iterable, Mapping

from immutables import Map

from gym_patches.checkpoint.identity import EpisodeId
from nemo_rl.experience.rollout_recovery import LedgerError, RolloutRecoveryLedger


class GymOwnershipError(RuntimeError):
    """Gym and the ledger disagree about who holds a rollout: a bug, never retried."""


@dataclass(frozen=True)
class SnapshotPlan:
    """What one snapshot asks of Gym, per instance (capture keys only: it is built while rollouts are held)."""

    instance_ids: tuple[str, ...]
    # instance -> capture key -> its agent: what the instance commits (the ledger's persistent map, or one
    # derived from it: a reference the ledger's later changes leave as it was)
    scope: dict[str, Mapping[str, str | None]]
    unsaved: dict[str, frozenset[str]]  # keys Gym said it cannot save (restart-only servers)
    # instances that left this snapshot (not parked in time): their rollouts are in no scope and
    # restart from the prompt if it is restored
    left_out: tuple[str, ...] = ()
    # of ``unsaved``, the keys that come back by replay: instance -> key -> the model server that writes
    # their record (their agent and tools save nothing; docs/design.md §4.8)
    replayed: dict[str, Mapping[str, str]] = field(default_factory=dict)

    @cached_property
    def scope_keys(self) -> dict[str, set[str]]:
        """Each instance's scope as a set of keys, made once, at first use: a pass over every rollout in
        the scope, for the set work after resume (the pause keeps the maps, docs/design.md §5.4)."""
        return {iid: set(agents) for iid, agents in self.scope.items()}

    @property
    def topology(self) -> tuple[str, ...]:
        """Every live instance, in the snapshot or not (what the ledger's inventory spans)."""
        return tuple(sorted(self.instance_ids + self.left_out))


_NO_KEYS: Map = Map()
# A capture key of attempt 1 or later (``gym_patches.checkpoint.identity``: a rollout id never ends so).
_RESTORED_KEY = re.compile(r"-a[1-9][0-9]*$")


class FirstCounts:
    """The rollouts this start's committed snapshots have counted as saved at turn level / unsaved, so
    that ``snapshots.jsonl`` can say how many rollouts each snapshot counts for the first time
    (``new_saved``, ``new_unsaved``) and the run's summary can add those up (docs/design.md §5.4).

    One instance per stager, for the whole start. Capture keys identify rollouts: within a start a
    rollout keeps its key (a restore bumps the attempt only at startup; a rerun from the prompt is a
    new rollout with a new key). A key of attempt 1 or later was restored at its turn, so a committed
    snapshot of an earlier start saved it: it is never counted again as saved. Only keys still held
    at turn level are kept (a rollout that finished never comes back under its key), so the sets
    stay the size of what is in flight, not of the run.
    """

    def __init__(self) -> None:
        self.saved: set[str] = set()
        self.unsaved: set[str] = set()


@dataclass(frozen=True)
class SnapshotKeys:
    """The capture keys behind one snapshot's counts. ``settle`` runs once the snapshot is committed, after
    the pause (the set work stays out of it); a snapshot that does not commit is never settled."""

    first: FirstCounts
    saved: list[str]
    unsaved: list[str]
    held: Mapping[str, set[str]]  # every instance's turn-level keys in the pause (``check_ownership``'s answer)

    def settle(self) -> tuple[int, int]:
        """Record this snapshot's rollouts; return how many of the saved / unsaved ones are counted first here."""
        first = self.first
        new_saved = {k for k in self.saved if k not in first.saved and not _RESTORED_KEY.search(k)}
        new_unsaved = {k for k in self.unsaved if k not in first.unsaved}
        live = set().union(*self.held.values()) if self.held else set()
        first.saved = {k for k in first.saved if k in live} | new_saved
        first.unsaved = {k for k in first.unsaved if k in live} | new_unsaved
        return len(new_saved), len(new_unsaved)


@dataclass(frozen=True)
class SnapshotCounts:
    """Turn-level rollouts of the snapshot: saved by Gym, on restart-only servers, refused by Gym and waiting;
    ``keys``: the keys behind them, to settle first counts with (None: not tracked)."""

    saved: int
    unsaved: int
    not_admitted: int
    keys: SnapshotKeys | None = None
    replayed: int = 0  # of the rollouts on restart-only servers, those that come back by replay


def gym_checkpoint_agents(ledger: RolloutRecoveryLedger, instance_ids: Iterable[str]) -> dict[str, Map]:
    """Per instance, the turn-level rollouts Gym holds: capture key -> ``agent_name``.

    Read from the ledger's ``turn_level_held``, which is kept up to date per changed group. This runs
    inside the pause, with every rollout held: it takes a reference to each instance's persistent map,
    which the ledger's later changes leave as it was (no copy, no pass over the ledger). An attempt on
    an instance outside ``instance_ids`` means the topology changed: ``LedgerError``.
    """
    held = ledger.turn_level_held()
    out = {iid: held.get(iid, _NO_KEYS) for iid in instance_ids}
    _check_topology(held, out)
    return out


def _check_topology(held: Mapping[str, Mapping[str, str | None]], instance_ids: Collection[str]) -> None:
    for iid, agents in held.items():
        if agents and iid not in instance_ids:
            raise LedgerError(
                f"rollout {next(iter(agents))} is held by Gym instance "
                f"{iid}, which is not in the live topology {sorted(instance_ids)}"
            )


def gym_checkpoint_keys(ledger: RolloutRecoveryLedger, instance_ids: Iterable[str]) -> dict[str, Map]:
    """``gym_checkpoint_agents`` where only the keys count (what the pause keeps of the ledger at its
    capture; ``held_sets`` makes sets of them, after resume)."""
    return gym_checkpoint_agents(ledger, instance_ids)


def held_sets(held: Mapping[str, Iterable[str]]) -> dict[str, set[str]]:
    """Per instance, the keys of ``gym_checkpoint_keys`` as a set (a pass over every rollout held: after resume)."""
    return {iid: set(keys) for iid, keys in held.items()}


def within(keys: Iterable[str], scope: Mapping[str, object]) -> set[str]:
    """The ``keys`` that ``scope`` holds: a pass over ``keys``, not over the scope."""
    return set(filter(scope.__contains__, keys))


def gym_checkpoint_inventory(
    ledger: RolloutRecoveryLedger, instance_ids: Iterable[str]
) -> dict[str, list[EpisodeId]]:
    """``gym_checkpoint_agents`` as ``EpisodeId`` lists (for callers outside the pause: it parses every key)."""
    return {iid: [EpisodeId.from_capture_key(key) for key in agents]
            for iid, agents in gym_checkpoint_agents(ledger, instance_ids).items()}


def plan_snapshot(
    ledger: RolloutRecoveryLedger,
    instance_ids: Iterable[str],
    gym_unsaved: Mapping[str, Iterable[str]],
    left_out: Iterable[str] = (),
    unsavable_agents: Mapping[str, Collection[str]] | None = None,
    replay_models: Mapping[str, Mapping[str, str]] | None = None,
) -> SnapshotPlan:
    """The commit scope of every instance, from one pass over the whole ledger (``left_out``:
    instances not in this snapshot; they get no scope).

    ``unsavable_agents[instance]``: agents whose rollouts touch a restart-only server there. Their
    rollouts are unsaved whatever Gym reported at prepare: a ``/run`` that reached a restart-only
    server after it answered prepare is not in its report, and must not be in a commit scope. What
    Gym reports unsaved but the ledger does not own (a validation rollout) is in no plan.
    ``replay_models[instance][agent]``: agents whose rollouts come back by replay, and the model server
    that writes their record: their unsaved rollouts are ``replayed`` (a pass over the unsaved ones)."""
    iids = tuple(sorted(instance_ids))
    out = tuple(sorted(set(left_out) - set(iids)))
    owned = gym_checkpoint_agents(ledger, iids + out)
    unsavable = unsavable_agents or {}
    unsaved = {}
    scope = {}
    replayed = {}
    for iid in iids:
        agents = unsavable.get(iid, ())
        late = {k for k, agent in owned[iid].items() if agent in agents} if agents else set()
        # Only the ledger's: Gym also holds rollouts no snapshot is about (validation runs, §5.6).
        unsaved[iid] = frozenset(within(gym_unsaved.get(iid, ()), owned[iid])) | late
        scope[iid] = _without(owned[iid], unsaved[iid])
        models = (replay_models or {}).get(iid) or {}
        replayed[iid] = {k: models[owned[iid][k]] for k in unsaved[iid] if owned[iid][k] in models} if models else {}
    return SnapshotPlan(iids, scope, unsaved, out, replayed)


def _without(agents: Map, keys: Collection[str]) -> Map:
    """``agents`` less ``keys``, at a cost that grows with ``keys`` (the map is persistent)."""
    if not keys:
        return agents
    with agents.mutate() as edit:
        for key in keys:
            del edit[key]
        return edit.finish()


def server_scopes(
    plan: SnapshotPlan,
    agent_servers: Mapping[str, Mapping[str, list[str]]],
) -> dict[str, dict[str, list[str]]]:
    """Per instance, per Gym server: the capture keys of the episodes that server takes part in
    (a replayed episode: its model server only).

    ``agent_servers[instance][agent]`` lists the servers an agent's rollouts
    touch (the agent, its model server, its resources server); a server no
    episode touches gets an empty scope and exports nothing.
    """
    out: dict[str, dict[str, list[str]]] = {}
    for iid in plan.instance_ids:
        servers_of = agent_servers.get(iid, {})
        by_server: dict[str, list[str]] = {}
        for key, model in plan.replayed.get(iid, {}).items():  # replayed: the model server's record only
            by_server.setdefault(model, []).append(key)
        for key, agent in plan.scope[iid].items():
            servers = servers_of.get(agent) if agent is not None else None
            if servers is None:
                raise GymOwnershipError(
                    f"rollout {key} on Gym instance {iid} belongs to agent {agent!r}, "
                    f"which that instance does not serve (agents: {sorted(servers_of)})"
                )
            for server in servers:
                by_server.setdefault(server, []).append(key)
        out[iid] = by_server
    return out


def episode_scopes(scopes: Mapping[str, Mapping[str, list[str]]]) -> dict[str, dict[str, list[EpisodeId]]]:
    """``server_scopes`` as the ``EpisodeId`` lists the control routes take (each key parsed once)."""
    parsed: dict[str, EpisodeId] = {}
    out: dict[str, dict[str, list[EpisodeId]]] = {}
    for iid, by_server in scopes.items():
        out[iid] = {}
        for server, keys in by_server.items():
            episodes = []
            for key in keys:
                episode = parsed.get(key)
                if episode is None:
                    episode = parsed[key] = EpisodeId.from_capture_key(key)
                episodes.append(episode)
            out[iid][server] = episodes
    return out


def check_ownership(
    plan: SnapshotPlan,
    exported: Mapping[str, Iterable[str]],
    not_started: Mapping[str, Iterable[str]] | None = None,
    *,
    held: Mapping[str, Iterable[str]],
) -> dict[str, set[str]]:
    """On every instance: nothing exported outside the scope; owned minus exported is unsaved.
    Returns what the ledger owns per instance (``count_snapshot`` takes it).

    ``held``: what the ledger held per instance when the snapshot's state was captured
    (``gym_checkpoint_keys`` then, over ``plan.topology``): the snapshotter checks after resume, on the
    references its pause kept (persistent views, unchanged since), never on the ledger as it moved on.
    ``not_started``: in-scope rollouts Gym holds but has not started (a ``/run`` that reached a saving
    agent after it closed, or one the drain did not see finish): they restart from the prompt after a
    crash, like unsaved ones, having lost nothing."""
    problems = []
    owned_by = held_sets(held)
    for iid in plan.instance_ids:
        done = set(exported.get(iid, ()))
        outside = done - plan.scope_keys[iid]
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
    return owned_by


def count_snapshot(
    plan: SnapshotPlan,
    exported: Mapping[str, Iterable[str]],
    not_started: Mapping[str, Iterable[str]] | None = None,
    first: FirstCounts | None = None,
    *,
    owned: Mapping[str, set[str]],
    refused_waiting: int,
) -> SnapshotCounts:
    """A snapshot's counts after resume, on what the pause fixed: ``owned`` (what ``check_ownership``
    passed and returned) and ``refused_waiting`` (the refused rollouts waiting at the capture).

    ``unsaved``: on restart-only servers, not replayable; ``replayed``: on restart-only servers, their record
    written for replay; ``not_admitted``: refused by Gym, or held there unstarted.
    ``first``: the start's ``FirstCounts``; the result's ``keys`` then settle what this snapshot counts first."""
    inventory, refused = owned, refused_waiting
    saved: list[str] = []
    unsaved: list[str] = []
    replayed = 0
    waiting = 0
    for iid in plan.instance_ids:  # set operations over every rollout held
        done = set(exported.get(iid, ()))
        idle = set((not_started or {}).get(iid, ()))
        held = inventory[iid]
        rest = held - done
        saved.extend(held & done)
        waiting += len(rest & idle)
        on_restart_only = (rest - idle) & plan.unsaved[iid]
        by_replay = on_restart_only & set(plan.replayed.get(iid, {}))
        replayed += len(by_replay)
        unsaved.extend(on_restart_only - by_replay)
    keys = SnapshotKeys(first, saved, unsaved, inventory) if first is not None else None
    return SnapshotCounts(len(saved), len(unsaved), waiting + refused, keys, replayed)
