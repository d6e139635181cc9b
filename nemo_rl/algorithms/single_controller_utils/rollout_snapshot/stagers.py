"""Stagers: how a snapshot holds rollouts, what it copies in the pause, and what it writes after.

One stager per ``rollout_checkpointing.commit_mode``, chosen once at setup
(``make_stager``); the snapshotter calls the same three methods on each (the
snapshot's directory is the run store's: ``stage`` asks it to ``begin`` one):

- ``hold(checkpoint_id)``: close the dispatch gate and prepare Gym with the
  stager's own ``PrepareAsk`` (a capture if it stages; at prefix, a generation
  cut of the prefix-level rollouts' calls only, docs/design.md §5.10) (an async
  context: leaving it resumes Gym and reopens the gate, whatever happened);
- ``stage(prepared, outcome)``: inside the pause: plan, Gym's share (blocking:
  its commit), the drain of the replies on the wire, then with no await what
  the ledger expects Gym to hold and the controller's state in memory, with
  the anchor it belongs to; returns a ``StagedSnapshot``. Nothing here passes
  over the rollouts held: the pause keeps references to the ledger's
  persistent views, and passes only over what changed during the prepare or
  was answered lately (docs/design.md §5.4);
- ``write(staged, outcome)``: after resume, on what the pause fixed
  (``PauseFacts``): what Gym saved of each scope and what restarts from the
  prompt, the ownership check and the counts, then Gym's files that are not
  written yet; returns the ``GymCheckpointIndex`` the snapshot publishes (None:
  no Gym).

``StagedStager`` (default): each Gym server copies its sessions as it is
prepared; they are written after resume (persist). ``BlockingStager``: Gym
writes its records inside the pause (commit). ``LedgerOnlyStager`` (sibling
and prompt_group levels): Gym is not asked and nothing is held.
"""

from __future__ import annotations

import contextlib
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, ClassVar, Mapping

from immutables import Map

from gym_patches.utils.collector import CollectorHold
from nemo_rl.algorithms.single_controller_utils.dispatch import DispatchGate, LedgerChanges
from nemo_rl.algorithms.single_controller_utils.gym_coordinator import (
    GymCheckpointCoordinator,
    PrepareAsk,
    PreparedGym,
)
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.generation_cut_scope import prefix_rollouts
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.inputs import SnapshotInputs
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.outcome import SnapshotOutcome
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.planner import (
    FirstCounts,
    GymOwnershipError,
    SnapshotPlan,
    check_ownership,
    count_snapshot,
    episode_scopes,
    gym_checkpoint_keys,
    plan_snapshot,
    server_scopes,
    within,
)
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.store import (
    ControllerStateCapture,
    GymCheckpointIndex,
    RunStore,
    SnapshotDir,
)
from nemo_rl.experience.rollout_recovery import RolloutAttemptStatus
from nemo_rl.utils.run_hooks import RunHooks

logger = logging.getLogger(__name__)
# How long the drain waits for in-scope rollouts Gym did not export (replies already on the wire).
DRAIN_GRACE_S = 2.0


@dataclass(frozen=True)
class StagedSnapshot:
    """What the pause captured; the write and the publish after resume need nothing else."""

    checkpoint_id: str
    step: int
    # the run store's directory: ``tmp`` (Gym's blocking commit already wrote into it) and ``final``, under the
    # anchor the capture belongs to (it may differ from tmp's: ``_GymStager.stage``)
    snapshot: SnapshotDir
    capture: ControllerStateCapture
    gym: Any = None  # a Gym stager's ``PauseFacts`` (None: ledger only)

    @property
    def tmp(self) -> Path:
        return self.snapshot.tmp


@dataclass(frozen=True)
class PauseFacts:
    """What a Gym snapshot's pause fixed, for the checks and counts that run after resume: they are pure
    functions of these, and the ledger moves on once rollouts are released."""

    prepared: PreparedGym
    plan: SnapshotPlan
    share: "_GymShare"
    reported_unstarted: dict[str, set[str]]  # instance -> in-scope runs a saving server got after it closed
    waited: dict[str, str]  # key -> instance: what the drain waited for (``drain_wait``)
    unfinished: dict[str, str]  # of those, what had neither sealed nor failed when the drain ended
    held: dict[str, Map]  # instance (the whole topology) -> the ledger's turn-level keys there, at the capture
    refused_waiting: int  # rollouts Gym refused that wait to be sent again, at the capture
    scopes: dict[str, dict[str, list[str]]] | None  # ``server_scopes``, when the pause needed them (blocking)


@dataclass(frozen=True)
class PendingPersist:
    """A staged snapshot's Gym half: each server writes its share of the turn-level saves from its capture."""

    scopes: dict[str, dict[str, list[str]]]  # instance -> server -> capture keys (``server_scopes``)
    exported: dict[str, set[str]]  # instance -> what its agents captured in the scope: continues at turn level
    unsaved: dict[str, list[str]]  # instance -> rollouts restart-only servers could not save
    # instance -> rollouts that come back by replay (live at the capture): their model record only (§4.8)
    replayed: dict[str, set[str]] = field(default_factory=dict)


class Stager(ABC):
    """One way of taking a snapshot (see the module docstring)."""

    mode: ClassVar[str]  # recorded as ``commit_mode`` in snapshots.jsonl

    def __init__(self, inputs: SnapshotInputs, hooks: RunHooks, store: RunStore):
        self.inputs = inputs
        self.hooks = hooks
        self.store = store

    @abstractmethod
    def hold(self, checkpoint_id: str) -> contextlib.AbstractAsyncContextManager[PreparedGym | None]: ...

    @abstractmethod
    async def stage(self, prepared: PreparedGym | None, outcome: SnapshotOutcome) -> StagedSnapshot: ...

    @abstractmethod
    async def write(self, staged: StagedSnapshot, outcome: SnapshotOutcome) -> GymCheckpointIndex | None: ...

    def _capture(self, outcome: SnapshotOutcome) -> ControllerStateCapture:
        """The controller's state, serialised (no awaits: a consistent picture of ledger and data plane),
        with the anchor read in the same instant: the snapshot belongs to it (``outcome.anchor_step``), even
        when a newer trainer step was published since the attempt began (docs/design.md §5.9). Groups
        the trainer took after the anchor are still complete in the ledger, with their samples: a
        restore re-trains them."""
        inputs = self.inputs
        outcome.anchor_step = inputs.anchor_step()
        return ControllerStateCapture.take(inputs.step(), outcome.anchor_step, inputs.ledger,
                                           inputs.dataloader.state_dict(), inputs.data_plane)


class LedgerOnlyStager(Stager):
    """Sibling and prompt_group levels: sealed samples and the ledger only; nothing is held."""

    mode = "ledger_only"

    @contextlib.asynccontextmanager
    async def hold(self, checkpoint_id: str) -> AsyncIterator[None]:
        yield None

    async def stage(self, prepared: None, outcome: SnapshotOutcome) -> StagedSnapshot:
        snapshot = self.store.begin(self.inputs.anchor_dir())  # no await up to the capture
        capture = self._capture(outcome)
        outcome.captured_bytes = capture.data_plane.nbytes
        return StagedSnapshot(outcome.checkpoint_id, outcome.step, snapshot, capture)

    async def write(self, staged: StagedSnapshot, outcome: SnapshotOutcome) -> None:
        return None


@dataclass(frozen=True)
class _GymShare:
    """What Gym saved of the scope inside the pause: the agents' turn-level saves, and (blocking)
    what each server wrote."""

    # instance -> capture keys that continue at turn level: what the commit wrote (blocking); None
    # (staged): the agents' captures, read after resume (``exported_keys``)
    exported: dict[str, set[str]] | None
    written: dict[str, dict[str, list[str]]] | None = None  # instance -> server -> keys written (blocking)
    cut_tokens: dict[str, dict[str, int]] | None = None  # instance -> key -> tokens of its generation cut (blocking)


def count_cuts(index: GymCheckpointIndex, outcome: SnapshotOutcome) -> None:
    """The snapshot row's ``cuts`` and ``cut_tokens``: the generation cuts it holds."""
    outcome.cuts = sum(len(c) for c in index.cut_tokens.values())
    outcome.cut_tokens = sum(n for c in index.cut_tokens.values() for n in c.values())


def note_cut(prepared: PreparedGym, outcome: SnapshotOutcome) -> None:
    """What each model server's cut noted at prepare: calls it cannot cut (no cut support), and why."""
    outcome.cut_asked = True
    errors = []
    for iid in prepared.instance_ids:
        for server, reply in sorted(prepared.results[iid].replies.items()):
            if reply.cut is not None and reply.cut.error:
                outcome.cut_failed += reply.cut.in_flight
                errors.append(f"{iid}/{server}: {reply.cut.error}")
    if errors:
        outcome.cut_error = "; ".join(errors)[:1000]
        logger.warning("snapshot %s: generation cut failed (those calls regenerate at turn level): %s",
                       outcome.checkpoint_id, outcome.cut_error)


class _GymStager(Stager):
    """The turn-level snapshot both Gym modes share; subclasses say what Gym does with the scope."""

    captures: ClassVar[bool]  # whether prepare asks each server to copy its sessions (staged)
    writes_in_pause: ClassVar[bool]  # whether Gym writes its records inside the pause (blocking: commit)

    def __init__(self, inputs: SnapshotInputs, hooks: RunHooks, coordinator: GymCheckpointCoordinator,
                 gate: DispatchGate, changes: LedgerChanges, store: RunStore):
        super().__init__(inputs, hooks, store)
        self.coordinator = coordinator
        self.gate = gate
        self.changes = changes
        self._collector = CollectorHold()
        self.first_counts = FirstCounts()  # rollouts this start's snapshots counted (the summary's distinct counts)

    @contextlib.asynccontextmanager
    async def hold(self, checkpoint_id: str) -> AsyncIterator[PreparedGym]:
        async with self.gate.closed():
            try:
                async with self.coordinator.prepared(checkpoint_id, self._prepare_ask()) as prepared:
                    self._collector.hold()  # prepared to resumed: no full collection while rollouts are held
                    yield prepared
            finally:
                self._collector.release()

    def _prepare_ask(self) -> PrepareAsk:
        """This stager's prepare, built with the gate closed: a capture if it stages, and a generation
        cut of the prefix-level rollouts' calls only when the run cuts (docs/design.md §5.10)."""
        if not self.inputs.generation_cuts:
            return PrepareAsk(capture=self.captures)
        return PrepareAsk(capture=self.captures, cut=True, cut_rollouts=prefix_rollouts(self.inputs.ledger))

    @abstractmethod
    async def _save_in_pause(self, prepared: PreparedGym, plan: SnapshotPlan, scopes: dict | None, tmp: Path,
                             outcome: SnapshotOutcome) -> _GymShare: ...

    def _unsavable_agents(self, restart_only: dict[str, list[str]]) -> dict[str, set[str]]:
        """Per instance, the agents whose rollouts touch one of its restart-only servers."""
        return {iid: {agent for agent, servers in agents.items() if set(servers) & set(restart_only.get(iid, ()))}
                for iid, agents in self.inputs.agent_servers.items()}

    async def stage(self, prepared: PreparedGym, outcome: SnapshotOutcome) -> StagedSnapshot:
        """The pause's work. The temporary directory is made under the anchor of now; when a trainer step is
        published during the awaits before the capture, the capture sees its groups trained and
        belongs to it: it is published under the new anchor (re-anchored, exact), its directory
        renamed there at the publish (docs/design.md §5.9). The checks and counts over every rollout
        held wait for ``write``, after resume (``PauseFacts``)."""
        inputs, step = self.inputs, outcome.step
        self.hooks.reached("prepare", step)
        if self.inputs.generation_cuts:
            note_cut(prepared, outcome)
        iids = prepared.instance_ids  # replicas that left the snapshot save nothing in it
        restart_only = self.coordinator.shard_set.restart_only_servers
        plan = plan_snapshot(inputs.ledger, iids, {iid: prepared.unsaved_keys(iid) for iid in iids}, prepared.left_out,
                             unsavable_agents=self._unsavable_agents(restart_only),
                             replay_models=inputs.replay_models)
        # A saving server reports as unsaved only runs that reached it after it closed: not started.
        reported_unstarted = {
            iid: {k for server, keys in prepared.results[iid].unsaved.items()
                  if server not in restart_only.get(iid, ()) for k in keys}
            for iid in iids
        }
        snapshot = self.store.begin(inputs.anchor_dir())
        try:
            scopes = server_scopes(plan, inputs.agent_servers) if self.writes_in_pause else None
            share = await self._save_in_pause(prepared, plan, scopes, snapshot.tmp, outcome)
            self.hooks.reached("commit", step)
            ended = {iid: prepared.results[iid].ended_keys() for iid in plan.scope}
            waited = drain_wait(plan.scope, ended, lambda iid: exported_keys(prepared, plan, share, iid))
            unfinished = await self._drain(waited, prepared.deadline_ts)
            outcome.mark("drain")
            # No awaits from here until the state is captured in memory (with its anchor).
            held = gym_checkpoint_keys(inputs.ledger, plan.topology)  # references to persistent maps
            refused = len(inputs.ledger.refused_waiting())
            capture = self._capture(outcome)
            snapshot = self.store.reanchor(snapshot, inputs.anchor_dir())  # a step published during the awaits
        except BaseException:
            self.store.abort(snapshot)
            raise
        facts = PauseFacts(prepared, plan, share, reported_unstarted, waited, unfinished, held, refused, scopes)
        return StagedSnapshot(outcome.checkpoint_id, step, snapshot, capture, facts)

    def _account(self, facts: PauseFacts, exported: dict[str, set[str]], not_started: dict[str, set[str]],
                 outcome: SnapshotOutcome) -> None:
        """After resume, on what the pause fixed: the ownership check (a bug if it fails: the snapshot
        is not published) and the snapshot's counts."""
        plan = facts.plan
        owned = check_ownership(plan, exported, not_started, held=facts.held)
        if plan.left_out:
            outcome.left_out = dict(facts.prepared.left_out)
            outcome.left_out_rollouts = sum(len(owned[iid]) for iid in plan.left_out)
        outcome.count(count_snapshot(plan, exported, not_started, self.first_counts, owned=owned,
                                     refused_waiting=facts.refused_waiting))

    async def write(self, staged: StagedSnapshot, outcome: SnapshotOutcome) -> GymCheckpointIndex:
        facts: PauseFacts = staged.gym
        plan = facts.plan
        exported = {iid: exported_keys(facts.prepared, plan, facts.share, iid) for iid in plan.instance_ids}
        not_started = unstarted_after_drain(plan.scope_keys, exported, facts.waited, facts.unfinished,
                                            facts.reported_unstarted)
        self._account(facts, exported, not_started, outcome)
        scopes = facts.scopes if facts.scopes is not None else server_scopes(plan, self.inputs.agent_servers)
        replayed = {iid: set(plan.replayed.get(iid, {})) & set(facts.held.get(iid, ())) for iid in plan.instance_ids}
        unsaved = {iid: sorted(plan.unsaved[iid] - replayed[iid]) for iid in plan.instance_ids}
        return await self._write_gym(staged, facts, scopes, exported, unsaved, outcome, replayed)

    @abstractmethod
    async def _write_gym(self, staged: StagedSnapshot, facts: PauseFacts, scopes: dict, exported: dict[str, set[str]],
                         unsaved: dict[str, list[str]], outcome: SnapshotOutcome,
                         replayed: dict[str, set[str]]) -> GymCheckpointIndex: ...

    async def _drain(self, waited: dict[str, str], deadline_ts: float) -> dict[str, str]:
        """Give the rollouts ``drain_wait`` chose (their reply may be on the wire) a moment to finish,
        without holding every rollout for them: returns those that have neither sealed nor failed after
        ``DRAIN_GRACE_S`` (key -> instance). Such a rollout, unless Gym saved it, restarts from its
        prompt after a crash (``unstarted_after_drain``)."""
        ledger = self.inputs.ledger
        pending = dict(waited)

        def settled() -> bool:
            for key in [k for k in pending if ledger.attempt_status(k) is not RolloutAttemptStatus.DISPATCHED]:
                del pending[key]
            return not pending

        try:
            await self.changes.wait_for(settled, timeout_s=max(0.1, min(DRAIN_GRACE_S, deadline_ts - time.time())))
        except TimeoutError:
            logger.info("snapshot drain: %d rollouts answered lately did not finish within %.1fs; those Gym did "
                        "not save restart from the prompt if this snapshot is restored: %s", len(pending), DRAIN_GRACE_S,
                        sorted(pending)[:5])
        return pending


def exported_keys(prepared: PreparedGym, plan: SnapshotPlan, share: _GymShare, iid: str) -> set[str]:
    """What instance ``iid`` saved of its scope at turn level: what its commit wrote (blocking), or what its
    agents captured at prepare (staged: taken from their replies after resume, a set over the scope)."""
    if share.exported is not None:
        return share.exported[iid]
    return prepared.results[iid].captured_keys("agent") & plan.scope_keys[iid]


def drain_wait(
    scope: Mapping[str, Mapping[str, str | None]], ended: Mapping[str, set[str] | None],
    exported_of: Callable[[str], set[str]],
) -> dict[str, str]:
    """In the pause: the in-scope rollouts whose reply may be on the wire (key -> instance), worth a short
    wait or their finished work would restart: those the instance's agents answered lately. That is a
    pass over what they answered, not over the scope; the few of them the agents also captured are
    waited for too (their replies are on the wire as well). Every other in-scope rollout Gym did not
    save has not reached its agent: nothing it did can be lost, and waiting for it would only lengthen
    the pause. An instance whose agents do not say what they answered (``None``) has every in-scope
    rollout Gym did not export (``exported_of``) waited for."""
    wait: dict[str, str] = {}
    for iid, keys in scope.items():
        answered = ended.get(iid)
        waited = set(keys) - exported_of(iid) if answered is None else within(answered, keys)
        wait.update(dict.fromkeys(waited, iid))
    return wait


def unstarted_after_drain(
    scope_keys: Mapping[str, set[str]], exported: Mapping[str, set[str]], waited: Mapping[str, str],
    unfinished: Mapping[str, str], reported: Mapping[str, set[str]],
) -> dict[str, set[str]]:
    """After resume: per instance, the in-scope rollouts Gym holds unstarted or not at all, which restart
    from the prompt after a crash having lost nothing: those a saving server reported it got after it
    closed (``reported``), those Gym did not save that the drain did not wait for, and those it waited
    for that neither sealed nor failed in time (``unfinished``) and Gym did not save."""
    waited_in: dict[str, set[str]] = {iid: set() for iid in scope_keys}
    for key, iid in waited.items():
        waited_in[iid].add(key)
    out = {iid: set(reported.get(iid, ())) | (keys - exported[iid] - waited_in[iid]) for iid, keys in scope_keys.items()}
    for key, iid in unfinished.items():
        if key not in exported[iid]:
            out[iid].add(key)
    return out


class BlockingStager(_GymStager):
    """Gym writes its records inside the pause (commit); after resume only the controller's files remain."""

    mode = "blocking"
    captures = False
    writes_in_pause = True

    async def _save_in_pause(self, prepared: PreparedGym, plan: SnapshotPlan, scopes: dict, tmp: Path,
                             outcome: SnapshotOutcome) -> _GymShare:
        commits = await self.coordinator.commit(prepared, str(tmp), episode_scopes(scopes))
        outcome.mark("commit")
        return _GymShare(exported={iid: set(commits[iid].agent_exported) for iid in plan.instance_ids},
                         written={iid: commits[iid].exported_by_server for iid in plan.instance_ids},
                         cut_tokens={iid: commits[iid].cut_tokens for iid in plan.instance_ids})

    async def _write_gym(self, staged: StagedSnapshot, facts: PauseFacts, scopes: dict, exported: dict[str, set[str]],
                         unsaved: dict[str, list[str]], outcome: SnapshotOutcome,
                         replayed: dict[str, set[str]]) -> GymCheckpointIndex:
        """Gym's records are in the directory already: only their index."""
        share = facts.share
        outcome.captured_bytes = staged.capture.data_plane.nbytes
        assert share.written is not None
        index = GymCheckpointIndex.from_written(staged.checkpoint_id, share.written, exported, unsaved,
                                                share.cut_tokens, replayed)
        count_cuts(index, outcome)
        return index


class StagedStager(_GymStager):
    """Each Gym server copies its sessions in memory as it is prepared; it writes them after resume."""

    mode = "staged"
    captures = True
    writes_in_pause = False

    async def _save_in_pause(self, prepared: PreparedGym, plan: SnapshotPlan, scopes: dict | None, tmp: Path,
                             outcome: SnapshotOutcome) -> _GymShare:
        # the agents' captures are the turn-level saves: read from their replies after resume (``exported_keys``)
        return _GymShare(exported=None)

    async def _write_gym(self, staged: StagedSnapshot, facts: PauseFacts, scopes: dict, exported: dict[str, set[str]],
                         unsaved: dict[str, list[str]], outcome: SnapshotOutcome,
                         replayed: dict[str, set[str]]) -> GymCheckpointIndex:
        """Every Gym server writes its share from the copy it took at prepare."""
        prepared = facts.prepared
        outcome.captured_bytes_by_server = {
            f"{iid}/{server}": n for iid in prepared.instance_ids
            for server, n in sorted(prepared.results[iid].captured_bytes().items())}
        outcome.captured_bytes = sum(outcome.captured_bytes_by_server.values()) + staged.capture.data_plane.nbytes
        index = await self.persist(staged.checkpoint_id, staged.tmp, PendingPersist(scopes, exported, unsaved, replayed),
                                   outcome, prepared.handles)
        outcome.mark("persist")
        count_cuts(index, outcome)
        return index

    async def persist(self, checkpoint_id: str, tmp: Path, pending: PendingPersist,
                      outcome: SnapshotOutcome | None = None, handles: dict[str, Any] | None = None
                      ) -> GymCheckpointIndex:
        """Every Gym server writes its scope from its capture; every turn-level save must be written. A
        replica that leaves meanwhile (lost, taken over by the in-run recovery, or a server silent past the
        park grace: docs/design.md §5.8) saves nothing in this snapshot: its rollouts are left out of the
        index (they restart from the prompt if it is restored) and the row says so."""
        persisted, left = await self.coordinator.persist(checkpoint_id, str(tmp), episode_scopes(pending.scopes),
                                                         handles)
        if left:
            pending = _without_replicas(pending, left, outcome)
        if outcome is not None:  # the model servers fetched their cuts' tokens just now
            failed = {iid: s for iid, s in persisted.items() if s.cut_error or s.cut_failed}
            outcome.cut_failed += sum(s.cut_failed for s in failed.values())
            errors = [f"{iid}/{s.cut_error}" for iid, s in sorted(failed.items()) if s.cut_error]
            if errors:
                outcome.cut_error = "; ".join(filter(None, [outcome.cut_error, *errors]))[:1000]
                logger.warning("snapshot %s: generation cuts incomplete (those calls regenerate at turn level): %s",
                               checkpoint_id, "; ".join(errors))
        for iid, keys in pending.exported.items():
            lost = keys - set(persisted[iid].agent_exported)
            if lost:
                raise GymOwnershipError(f"Gym instance {iid}: agents captured {sorted(lost)[:10]} at prepare but "
                                        "did not write them")
        written = {iid: persisted[iid].exported_by_server for iid in pending.exported}
        return GymCheckpointIndex.from_written(checkpoint_id, written, pending.exported, pending.unsaved,
                                               {iid: persisted[iid].cut_tokens for iid in pending.exported},
                                               pending.replayed)


def _without_replicas(pending: PendingPersist, left: dict[str, str], outcome: SnapshotOutcome | None) -> PendingPersist:
    """``pending`` less the replicas that left during the persist; the row counts their rollouts as left out."""
    if outcome is not None:
        lost = sum(len(pending.exported.get(iid, ())) for iid in left)
        outcome.left_out = {**outcome.left_out, **left}
        outcome.left_out_rollouts += lost
        outcome.saved = max(0, outcome.saved - lost)
    return PendingPersist({iid: v for iid, v in pending.scopes.items() if iid not in left},
                          {iid: v for iid, v in pending.exported.items() if iid not in left},
                          {iid: v for iid, v in pending.unsaved.items() if iid not in left},
                          {iid: v for iid, v in pending.replayed.items() if iid not in left})


STAGERS: dict[str, type[_GymStager]] = {"staged": StagedStager, "blocking": BlockingStager}


def make_stager(commit_mode: str, inputs: SnapshotInputs, hooks: RunHooks,
                coordinator: GymCheckpointCoordinator | None, gate: DispatchGate, changes: LedgerChanges,
                store: RunStore) -> Stager:
    """The stager for this run: ledger-only without Gym checkpoints, else ``commit_mode``'s; each
    snapshot's directory is ``store``'s."""
    if coordinator is None:
        return LedgerOnlyStager(inputs, hooks, store)
    try:
        cls = STAGERS[commit_mode]
    except KeyError:
        raise ValueError(f"rollout_checkpointing.commit_mode={commit_mode!r}: expected one of "
                         f"{', '.join(sorted(STAGERS))}") from None
    return cls(inputs, hooks, coordinator, gate, changes, store)
