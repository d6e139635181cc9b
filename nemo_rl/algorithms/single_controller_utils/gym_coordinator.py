"""Checkpoint calls across every Gym replica, under one deadline.

``GymCheckpointCoordinator.prepared()`` is the scope of one snapshot: prepare
all replicas, keep their leases renewed, and always resume them on the way out
(also on error or cancellation) so Gym is never left closed by us.

A replica that cannot be parked in time leaves the snapshot instead of holding
the others (docs/design.md §5.8, "Hung Gym servers"): one whose servers do not
answer a status probe leaves at once, one still preparing ``park_grace_s`` after
every other replica is prepared leaves then; it is resumed at once, its rollouts
are not saved in this snapshot, and the reason names the server. A replica whose
resume failed sits the next snapshot out while it is reopened.

The prepare itself is a ``PrepareRound`` (``prepare_rounds.py``): one small state machine per
replica, which this module drives tick by tick and acts on (logging, cancelling in the actor,
resuming the replicas that leave); ``Reopenings`` (``reopenings.py``) owns the resumes that go on
after a snapshot.

Each operation builds its typed request (``gym_patches.checkpoint.calls``) once
and sends it to every replica's one ``checkpoint`` entry; only what differs per
replica (its scope, its directory, its servers' policies, the rollouts its generation
cut takes) is filled in per copy. What a prepare asks beyond the id, the deadline and
the policies is the stager's ``PrepareAsk``, sent as built.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import ray

from gym_patches.checkpoint.calls import (
    CommitCall,
    ForgetCall,
    GymCall,
    PersistCall,
    PrepareCall,
    ProbeCall,
    RenewCall,
    RestoreCall,
    ResumeCall,
    RetireCall,
)
from gym_patches.checkpoint.identity import EpisodeId
from gym_patches.checkpoint.wire import MAX_EPISODES_PER_REQUEST, RestartOnlyPolicy
from gym_patches.checkpoint.coordination import CoordinationError, PrepareResult
from nemo_rl.algorithms.single_controller_utils.prepare_rounds import (
    PersistStragglers,
    PrepareRound,
    ReplicaPrepare,
    RoundClock,
    finished_error,
    unwrap,
)
from nemo_rl.algorithms.single_controller_utils.replica_guards import ReplicaGuards
from nemo_rl.algorithms.single_controller_utils.reopenings import Reopenings
from nemo_rl.environments.gym_checkpoint_adapter import (
    GymCheckpointCommitSummary,
    GymCheckpointInstance,
)
from nemo_rl.environments.nemo_gym import GymReplicaLost, NemoGymShardSet

logger = logging.getLogger(__name__)
_MAX_REPLY_GRACE_S = 5.0
# Each server's resume call: a hung server fails its own quickly and the others reopen.
RESUME_CALL_TIMEOUT_S = 5.0
FORGET_TIMEOUT_S = 10.0  # a forget that has not answered by then is tried again with the next one
PROBE_AFTER_S = 0.5  # a replica still preparing after this long has its servers' status probed ...
PROBE_EVERY_S = 1.0  # ... this often, until it is prepared or leaves the snapshot
_TICK_S = 0.1


class GymCheckpointNotReady(RuntimeError):
    """Some replica did not prepare by the deadline; ``blockers[instance][server]`` = keys."""

    def __init__(self, blockers: dict[str, dict[str, list[str]]], left_out: dict[str, str] | None = None):
        self.blockers = blockers
        self.left_out = dict(left_out or {})
        parts = []
        for iid, servers in sorted(blockers.items()):
            for server, keys in sorted(servers.items()):
                shown = ", ".join(keys[:5]) + (", ..." if len(keys) > 5 else "")
                parts.append(f"{server!r} on {iid} ({len(keys)} blocking: {shown})")
        parts += [f"{iid} left out: {why}" for iid, why in sorted(self.left_out.items())]
        super().__init__("Gym not ready for a checkpoint: " + "; ".join(parts))

    @property
    def blocking_servers(self) -> list[str]:
        return sorted({s for servers in self.blockers.values() for s in servers})

    def __reduce__(self):
        return (GymCheckpointNotReady, (self.blockers, self.left_out))


class GymReplicasLeftOut(RuntimeError):
    """Every replica left the snapshot (none could be parked); ``left_out[instance]`` says why,
    naming the server that did not answer."""

    def __init__(self, left_out: dict[str, str]):
        self.left_out = dict(left_out)
        super().__init__("no Gym replica could be prepared for a checkpoint: "
                         + "; ".join(f"{iid}: {why}" for iid, why in sorted(self.left_out.items())))

    def __reduce__(self):
        return (GymReplicasLeftOut, (self.left_out,))


class GymCheckpointOperationError(RuntimeError):
    """An operation failed on some replicas; ``failures[instance]`` = the error as Gym raised it.

    The one wrap between Gym and the controller: it names the operation and
    each replica; each error inside names its server.
    """

    def __init__(self, operation: str, failures: dict[str, BaseException]):
        self.operation, self.failures = operation, failures
        super().__init__(
            f"Gym checkpoint {operation} failed on "
            + "; ".join(f"{iid}: {exc}" for iid, exc in sorted(failures.items()))
        )


def is_transient_gym_checkpoint_failure(exc: BaseException) -> bool:
    """Not-ready, unreachable and unanswering Gym are retried at the next interval; anything else is a bug."""
    if isinstance(exc, (GymCheckpointNotReady, GymReplicasLeftOut)):
        return True
    if isinstance(exc, GymCheckpointOperationError):
        # A replica that did not answer in time is as transient as one whose server did not.
        return all(isinstance(e, (CoordinationError, TimeoutError, ray.exceptions.RayActorError))
                   for e in exc.failures.values())
    return False


@dataclass
class PreparedGym:
    """What a successful prepare gives the snapshot: the ``PrepareResult`` of every replica that
    takes part, and why each other one left it (its rollouts are not saved in this snapshot)."""

    checkpoint_id: str
    deadline_ts: float
    results: dict[str, PrepareResult]
    left_out: dict[str, str] = field(default_factory=dict)
    # instance -> the control actor it was prepared through: every later call of this snapshot goes there, so a
    # replica replaced meanwhile (docs/design.md §5.12) is never asked about a checkpoint its new servers never saw
    handles: dict[str, Any] = field(default_factory=dict)

    @property
    def instance_ids(self) -> list[str]:
        return sorted(self.results)

    def unsaved_keys(self, instance_id: str) -> set[str]:
        return self.results[instance_id].unsaved_keys()


@dataclass(frozen=True)
class PrepareAsk:
    """What a stager asks of each replica's prepare; the coordinator adds the snapshot id, the deadline
    and the restart-only policies and sends the rest as built (docs/design.md §5.10).

    ``capture``: each server copies its sessions as it is prepared (staged). ``cut``: the model servers
    take a generation cut; ``cut_rollouts`` (instance -> rollout ids) limits each replica's cut to the
    calls of its prefix-level rollouts (None: every call in flight, when every rollout is at prefix)."""

    capture: bool = False
    cut: bool = False
    cut_rollouts: dict[str, list[str]] | None = None

    def fields_for(self, instance_id: str) -> dict[str, Any]:
        """The prepare request's fields for one replica."""
        rollouts = None if self.cut_rollouts is None or not self.cut else self.cut_rollouts.get(instance_id, [])
        return {"capture": self.capture, "cut": self.cut, "cut_rollouts": rollouts}


class GymCheckpointCoordinator:
    def __init__(self, shard_set: NemoGymShardSet, prepare_timeout_s: float, restart_only_policy: RestartOnlyPolicy,
                 park_grace_s: float = 1.5, recovers_lost: bool = False):
        self.shard_set = shard_set
        self.recovers_lost = recovers_lost  # the in-run recovery replaces a lost replica (§5.12)
        self.guards = ReplicaGuards()  # a snapshot's pause and a recovery's install never overlap on a replica
        # replicas the in-run recovery took over (-> why): any snapshot call to them stops and they leave it
        self._abandoned: dict[str, str] = {}
        self.on_lost: Callable[[str, str], None] = lambda iid, why: None  # a replica's actor is gone (§5.12)
        self.prepare_timeout_s = prepare_timeout_s
        self.policy = restart_only_policy
        self.park_grace_s = park_grace_s
        # instance -> checkpoint id some of its servers did not resume -> why: it sits snapshots out until reopened
        # through the control actor that failed to resume it (a replica replaced since owes nothing)
        self._unresumed: dict[str, dict[str, tuple[str, Any]]] = {}
        self._reopenings = Reopenings()  # left-out replicas' resumes, owned until each ends or ``aclose``
        self._unforgotten: dict[str, list[str]] = {}  # replica -> finished rollouts it has yet to forget

    @property
    def instance_ids(self) -> list[str]:
        return sorted(self.shard_set.checkpoint_handles)

    async def _collect(self, operation: str, calls: dict[str, Awaitable[Any]], deadline_ts: float,
                       handles: dict[str, Any] | None = None) -> dict[str, Any]:
        """Await every replica until the deadline plus a short grace; name the failures."""
        out, failures = await self._gather_replicas(operation, calls, deadline_ts, handles)
        if failures:
            raise GymCheckpointOperationError(operation, failures)
        return out

    async def _gather_replicas(
        self, operation: str, calls: dict[str, Awaitable[Any]], deadline_ts: float,
        handles: dict[str, Any] | None = None,
    ) -> tuple[dict[str, Any], dict[str, BaseException]]:
        """Every replica's answer or error (a lost replica is raised as ``GymReplicaLost``)."""
        grace = min(self.prepare_timeout_s, _MAX_REPLY_GRACE_S)
        timeout = max(0.1, deadline_ts - time.time() + grace)
        tasks = {iid: asyncio.ensure_future(c) for iid, c in calls.items()}
        try:
            done, pending = await asyncio.wait(tasks.values(), timeout=timeout)
        except BaseException:  # cancelled: no replica call is left behind unobserved
            for task in tasks.values():
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
            raise
        failures: dict[str, BaseException] = {}
        out: dict[str, Any] = {}
        for iid, task in tasks.items():
            if task in pending:
                task.cancel()
                failures[iid] = TimeoutError(f"{operation} on {iid} did not answer within {timeout:.1f}s")
            elif task.exception() is not None:
                failures[iid] = unwrap(task.exception())
            else:
                out[iid] = task.result()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        self._raise_if_lost(failures, handles)
        return out, failures

    def abandon(self, instance_id: str, why: str) -> None:
        """The in-run recovery took ``instance_id`` over (a server or its actor was lost): a snapshot's calls
        to it stop at once and it leaves that snapshot, until ``forget_instance`` (docs/design.md §5.12)."""
        self._abandoned[instance_id] = why

    def forget_instance(self, instance_id: str) -> None:
        """A replica was replaced or given up (docs/design.md §5.12): nothing is owed to its old servers."""
        self._unresumed.pop(instance_id, None)
        self._unforgotten.pop(instance_id, None)
        self._abandoned.pop(instance_id, None)

    def _raise_if_lost(self, failures: dict[str, BaseException], handles: dict[str, Any] | None = None) -> None:
        """A replica whose actor died is lost: the run stops naming it, unless the in-run recovery
        replaces it (``recovers_lost``): then the recovery is told (``on_lost``; not about an actor
        ``handles`` pinned that was replaced since) and it is one more replica that did not answer."""
        for iid, exc in sorted(failures.items()):
            if isinstance(exc, ray.exceptions.RayActorError):
                if not self.recovers_lost:
                    raise GymReplicaLost(iid, exc, self.shard_set.placement.get(iid)) from None
                if handles is None or handles.get(iid) is self.shard_set.control_handles.get(iid):
                    self.on_lost(iid, f"its Ray actor died ({_first_line(exc)})")

    def _send(self, iid: str, request: GymCall, handles: dict[str, Any] | None = None) -> Any:
        """``request`` to one replica's checkpoint entry: the control actor ``handles`` pins (a snapshot's),
        else the replica's current one."""
        if handles is not None and iid in handles:
            return handles[iid].checkpoint.remote(request)
        return self.shard_set.send_checkpoint(iid, request)

    async def retire(self, checkpoint_id: str, episodes: dict[str, list[EpisodeId]]) -> None:
        deadline = time.time() + self.prepare_timeout_s
        calls = {
            iid: self._send(iid, RetireCall(checkpoint_id=checkpoint_id, deadline_ts=deadline, episode_ids=eps))
            for iid, eps in episodes.items()
            if eps
        }
        if calls:
            await self._collect("retire", calls, deadline)

    @contextlib.asynccontextmanager
    async def prepared(self, checkpoint_id: str, ask: PrepareAsk = PrepareAsk()) -> AsyncIterator[PreparedGym]:
        """Prepare every replica as the stager's ``ask`` says (``capture``: each server serialises its
        sessions as it becomes prepared, for ``persist`` after resume; ``cut``: which model calls a
        generation cut takes); resume all of them on exit, whatever happened.

        Replicas that cannot be parked in time leave the snapshot (``PreparedGym.left_out``); if
        every one does, ``GymReplicasLeftOut`` names them."""
        deadline = time.time() + self.prepare_timeout_s
        renewer: asyncio.Task | None = None
        leavers: dict[str, asyncio.Task] = {}  # left-out replicas being resumed meanwhile
        left_out = self._sit_out_unresumed(leavers)
        left_out.update(self._sit_out_recovering(left_out))
        asked = [iid for iid in self.instance_ids if iid not in left_out]
        handles = {iid: self.shard_set.control_handles[iid] for iid in asked if iid in self.shard_set.control_handles}
        async with self.guards.hold(asked):  # free: ``_sit_out_recovering`` passed over the held ones
            try:
                results = await self._prepare_replicas(checkpoint_id, asked, deadline, ask, left_out, leavers, handles)
                not_ready = {iid: r.blockers for iid, r in results.items() if not r.prepared}
                if not_ready:
                    raise GymCheckpointNotReady(not_ready, left_out)
                if not results:
                    raise GymReplicasLeftOut(left_out)
                for iid in results:
                    self.shard_set.mark_healthy(iid)
                renewer = asyncio.create_task(self._renew_until_stopped(checkpoint_id, sorted(results), handles),
                                              name=f"gym-renew:{checkpoint_id}")
                yield PreparedGym(checkpoint_id, deadline, results, dict(left_out), handles)
            finally:
                if renewer is not None:
                    renewer.cancel()
                    await asyncio.gather(renewer, return_exceptions=True)
                    if (exc := finished_error(renewer)) is not None:
                        logger.error("lease renewal for %s stopped: %s: %s", checkpoint_id, type(exc).__name__, exc)
                try:
                    await self.resume(checkpoint_id, [iid for iid in asked if iid not in leavers], handles)
                finally:
                    # Left-out replicas finish reopening in the background (each call is short); until
                    # then they sit snapshots out. ``aclose`` stops what is left when the run ends.
                    for iid, task in leavers.items():
                        self._reopenings.adopt(iid, task, left_out.get(iid, "a server did not answer"))

    def _sit_out_recovering(self, left_out: dict[str, str]) -> dict[str, str]:
        """Replicas the in-run recovery holds (being replaced, or installing saved episodes) sit this
        snapshot out: their rollouts are the recovery's (docs/design.md §5.12)."""
        held = set(self.instance_ids) - set(self.guards.free(self.instance_ids))
        busy = (set(self.shard_set.recovering) | set(self._abandoned) | held) - set(left_out)
        return {iid: f"{iid} is being recovered (in-run recovery)" for iid in sorted(busy)}

    async def reopened(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) for the replicas being reopened after they left a snapshot."""
        await self._reopenings.wait(timeout_s)

    async def aclose(self) -> None:
        """Stop reopening left-out replicas (the run is ending; their leases reopen them)."""
        await self._reopenings.aclose()

    async def _prepare_replicas(
        self, checkpoint_id: str, asked: list[str], deadline: float, ask: PrepareAsk,
        left_out: dict[str, str], leavers: dict[str, asyncio.Task], handles: dict[str, Any],
    ) -> dict[str, PrepareResult]:
        """Prepare ``asked`` at once; probe the servers of replicas that take long; move replicas
        that cannot be parked into ``left_out`` (each resumed at once by a task in ``leavers``), and
        those the in-run recovery takes over meanwhile. Each tick drives the round's transitions in
        this order (``prepare_rounds.py``)."""
        calls = {iid: self._send(iid, self._prepare_call(checkpoint_id, deadline, ask, iid), handles)
                 for iid in asked}
        round_ = PrepareRound.start(checkpoint_id, calls, self._round_clock(deadline),
                                    lost_actor_leaves=self.recovers_lost)
        probe = ProbeCall(timeout_s=self.park_grace_s)
        try:
            while round_.waiting():
                await round_.next_event(_TICK_S)
                now = time.monotonic()
                self._let_go(checkpoint_id, round_.read_answers(), left_out, leavers, handles)
                self._let_go(checkpoint_id, round_.abandon(self._abandoned), left_out, leavers, handles)
                round_.start_grace(now)
                for replica in round_.due_for_probe(now):
                    replica.probe_sent(self._send(replica.iid, probe, handles), now)
                self._let_go(checkpoint_id, round_.stragglers(now), left_out, leavers, handles)
                round_.stop_the_late(now)
        finally:
            await round_.close()
        failures = round_.failures()
        self._raise_if_lost(failures, handles)
        if failures:
            raise GymCheckpointOperationError("prepare", failures)
        return round_.results()

    def _prepare_call(self, checkpoint_id: str, deadline: float, ask: PrepareAsk, iid: str) -> PrepareCall:
        """One replica's prepare: the stager's ask with the id, the deadline and the servers' policies."""
        override = self.shard_set.prepare_policy_overrides.get(iid)
        return PrepareCall(checkpoint_id=checkpoint_id, deadline_ts=deadline, restart_only_policy=self.policy,
                           policy_overrides=override or None, **ask.fields_for(iid))

    def _round_clock(self, deadline: float) -> RoundClock:
        """The round's times: it stops at the deadline plus the reply grace; the probe periods are
        read at each prepare (tests shorten them)."""
        started = time.monotonic()
        reply_grace = min(self.prepare_timeout_s, _MAX_REPLY_GRACE_S)
        return RoundClock(started=started, hard_stop=started + max(0.1, deadline - time.time()) + reply_grace,
                          park_grace_s=self.park_grace_s, probe_after_s=PROBE_AFTER_S, probe_every_s=PROBE_EVERY_S)

    def _let_go(self, checkpoint_id: str, leaving: list[ReplicaPrepare], left_out: dict[str, str],
                leavers: dict[str, asyncio.Task], handles: dict[str, Any]) -> None:
        """Replicas that left the round: say why, stop their prepare in the actor, pass them over for
        new rollouts a while, and resume each at once (its resume task goes to ``leavers``)."""
        for replica in leaving:
            left_out[replica.iid] = replica.why_left
            logger.warning("snapshot %s: %s leaves this snapshot (its rollouts are not saved in it): %s",
                           checkpoint_id, replica.iid, replica.why_left)
            if isinstance(replica.call, ray.ObjectRef):  # (``ray.cancel`` of anything else would start Ray)
                with contextlib.suppress(Exception):  # its prepare stops in the actor; the resume reopens what it closed
                    ray.cancel(replica.call)
            if replica.iid in self._abandoned:
                continue  # the recovery replaces it: its old servers are not reopened
            self.shard_set.mark_unhealthy(replica.iid, replica.why_left)
            leavers[replica.iid] = asyncio.create_task(self.resume(checkpoint_id, [replica.iid], handles),
                                                       name=f"gym-leave:{replica.iid}")

    def _sit_out_unresumed(self, leavers: dict[str, asyncio.Task]) -> dict[str, str]:
        """Replicas whose earlier resume failed (a server did not answer) sit this snapshot out: one
        still closed under an old id would refuse the prepare as a conflict, and waiting for it here
        would hold the others. Each is reopened meanwhile, by a task in ``leavers``."""
        left = {iid: f"{iid} is still being reopened after it left a snapshot: {why}"
                for iid, why in self._reopenings.running().items()}
        for iid, cids in sorted(self._unresumed.items()):
            current = self.shard_set.control_handles.get(iid)
            for cid in [c for c, (_, handle) in cids.items() if handle is not current]:
                del cids[cid]  # its servers were replaced since (docs/design.md §5.12): nothing to reopen
            if not cids:
                del self._unresumed[iid]
                continue
            if iid in left:
                continue
            left[iid] = f"{iid} has not reopened after checkpoint(s) {', '.join(sorted(cids))}, being reopened " \
                        f"meanwhile: {'; '.join(cids[c][0] for c in sorted(cids))}"
            leavers[iid] = asyncio.create_task(self._reopen(iid, sorted(cids), current), name=f"gym-reopen:{iid}")
        return left

    async def _reopen(self, iid: str, checkpoint_ids: list[str], handle: Any) -> None:
        for cid in checkpoint_ids:
            await self.resume(cid, [iid], {iid: handle})

    async def _renew_until_stopped(self, checkpoint_id: str, iids: list[str], handles: dict[str, Any]) -> None:
        period = max(0.05, min(self.prepare_timeout_s / 3, 10.0))
        while True:
            await asyncio.sleep(period)
            deadline = time.time() + self.prepare_timeout_s
            request = RenewCall(checkpoint_id=checkpoint_id, deadline_ts=deadline)
            asked = [iid for iid in iids if iid not in self._abandoned]
            try:
                await self._collect("renew", {iid: self._send(iid, request, handles) for iid in asked}, deadline,
                                    handles)
            except GymCheckpointOperationError as exc:
                logger.warning("lease renewal for %s failed: %s", checkpoint_id, exc)

    async def commit(
        self, prepared: PreparedGym, root: str, scope: dict[str, dict[str, list[EpisodeId]]]
    ) -> dict[str, GymCheckpointCommitSummary]:
        """Each replica's servers write only their own episodes, ``scope[iid][server]``, inside the pause."""
        deadline = time.time() + self.prepare_timeout_s
        return await self._collect(
            "commit",
            {
                iid: self._send(iid, CommitCall(
                    checkpoint_id=prepared.checkpoint_id, deadline_ts=deadline,
                    checkpoint_dir=self.shard_set.checkpoint_dir(iid, root), episode_ids=scope.get(iid, {})),
                    prepared.handles)
                for iid in prepared.instance_ids
            },
            deadline, prepared.handles,
        )

    async def forget(self, rollout_ids: list[str]) -> int:
        """Every replica drops what its servers keep about these finished rollouts (chunked). A replica
        that is not reopened yet (it left a snapshot) gets them later, with the next forget it can take."""
        total = 0
        closed = set(self._unresumed) | set(self._reopenings.running())
        for iid in self.instance_ids:
            self._unforgotten.setdefault(iid, []).extend(rollout_ids)
        for iid in self.instance_ids:
            if iid in closed:
                continue
            ids, self._unforgotten[iid] = self._unforgotten[iid], []
            try:
                for start in range(0, len(ids), MAX_EPISODES_PER_REQUEST):
                    chunk = ids[start:start + MAX_EPISODES_PER_REQUEST]
                    # Short: the training loop waits for it, and a hung server must not hold a step.
                    deadline = time.time() + min(self.prepare_timeout_s, FORGET_TIMEOUT_S)
                    request = ForgetCall(checkpoint_id=f"forget-{uuid.uuid4().hex[:12]}", deadline_ts=deadline,
                                         rollout_ids=chunk)
                    done = await self._collect("forget", {iid: self._send(iid, request)}, deadline)
                    total += done[iid]
            except BaseException:
                self._unforgotten[iid] = ids + self._unforgotten[iid]  # tried again with the next forget
                raise
        return total

    async def persist(
        self, checkpoint_id: str, root: str, scope: dict[str, dict[str, list[EpisodeId]]],
        handles: dict[str, Any] | None = None,
    ) -> tuple[dict[str, GymCheckpointCommitSummary], dict[str, str]]:
        """Each replica of ``scope`` (those that took part) writes ``scope[iid][server]`` from what its
        capture prepare serialised (Gym is already resumed). Returns what each wrote, and the replicas
        that left (-> why): the in-run recovery took one over, its actor was lost, or, once every other
        replica has written, a server of it stayed silent to a status probe past ``park_grace_s`` (a
        stopped or hung server: docs/design.md §5.8). If every replica leaves, ``GymReplicasLeftOut``."""
        deadline = time.time() + self.prepare_timeout_s
        calls = {iid: self._send(iid, PersistCall(checkpoint_id=checkpoint_id, deadline_ts=deadline,
                                                  checkpoint_dir=self.shard_set.checkpoint_dir(iid, root),
                                                  episode_ids=by_server), handles)
                 for iid, by_server in scope.items()}
        straggle = PersistStragglers(calls, self.park_grace_s, deadline - time.time() + _MAX_REPLY_GRACE_S,
                                     lost_actor_leaves=self.recovers_lost)
        try:
            while straggle.waiting():
                await straggle.next_event(_TICK_S)
                straggle.abandon(self._abandoned)
                for iid in straggle.due_for_probe(time.monotonic(), PROBE_EVERY_S):
                    straggle.probe_sent(iid, self._send(iid, ProbeCall(timeout_s=self.park_grace_s), handles))
        finally:
            await straggle.close()
        for iid, why in sorted(straggle.left_out.items()):
            logger.warning("snapshot %s: %s leaves this snapshot while persisting (its rollouts are not saved in "
                           "it): %s", checkpoint_id, iid, why)
        failures = straggle.failures()
        self._raise_if_lost(failures, handles)
        if failures:
            raise GymCheckpointOperationError("persist", failures)
        if scope and not straggle.results():
            raise GymReplicasLeftOut(straggle.left_out)
        return straggle.results(), dict(straggle.left_out)

    async def resume(self, checkpoint_id: str, iids: list[str] | None = None,
                     handles: dict[str, Any] | None = None) -> dict[str, BaseException]:
        """Reopen ``iids`` (default: every replica; through ``handles`` when a snapshot pinned them);
        each server's call is short, so one hung server never keeps the others closed. A replica that did
        not fully reopen is remembered and reopened before its next prepare (the lease reopens it anyway,
        later); one the recovery took over is not asked. Returns the failures."""
        deadline = time.time() + self.prepare_timeout_s
        targets = [iid for iid in (self.instance_ids if iids is None else iids) if iid not in self._abandoned]
        if not targets:
            return {}
        request = ResumeCall(checkpoint_id=checkpoint_id, deadline_ts=deadline, call_timeout_s=RESUME_CALL_TIMEOUT_S)
        # Short calls, to every server of a replica at once: a replica that has not answered well
        # after one call's timeout (its round trip through a busy Gym actor included) has failed it.
        _, failures = await self._gather_replicas(
            "resume", {iid: self._send(iid, request, handles) for iid in targets},
            min(deadline, time.time() + 3 * RESUME_CALL_TIMEOUT_S), handles,
        )
        for iid in targets:
            used = handles[iid] if handles is not None and iid in handles else self.shard_set.control_handles.get(iid)
            if iid in failures and used is not self.shard_set.control_handles.get(iid):
                failures.pop(iid)  # an actor replaced since (docs/design.md §5.12): nothing is owed to its successor
            elif iid in failures:
                self._unresumed.setdefault(iid, {})[checkpoint_id] = (str(failures[iid]), used)
            elif iid in self._unresumed:
                self._unresumed[iid].pop(checkpoint_id, None)
                if not self._unresumed[iid]:
                    del self._unresumed[iid]
        if failures:
            # Report, don't mask the caller's error: the next prepare reopens them first.
            logger.error("resume of %s failed on %s (reopened before the next snapshot; Gym also reopens "
                         "itself when the lease expires): %s", checkpoint_id, ", ".join(sorted(failures)),
                         "; ".join(f"{iid}: {exc}" for iid, exc in sorted(failures.items())))
        return failures

    async def unportable_servers(self, shards: list[str], among: list[str] | None = None) -> dict[str, set[str]]:
        """shard -> its Gym servers whose status says their records are not portable (asked of the
        first running replica of each shard in ``shards``, of ``among`` when given; an elastic restore asks
        before it moves any episode). A replica that does not answer fails the restore, naming it."""
        asked: dict[str, str] = {}
        for iid in (self.instance_ids if among is None else sorted(among)):
            shard = iid.rsplit("/replica-", 1)[0]
            if shard in shards and shard not in asked:
                asked[shard] = iid
        deadline = time.time() + self.park_grace_s
        probes = await self._collect("status", {iid: self._send(iid, ProbeCall(timeout_s=self.park_grace_s))
                                                for iid in asked.values()}, deadline)
        silent = {iid: name for iid, by_name in probes.items() for name, p in by_name.items() if not p.answered}
        if silent:
            raise GymCheckpointOperationError("status", {
                iid: RuntimeError(f"Gym server {name!r} did not answer its status") for iid, name in silent.items()})
        return {shard: {name for name, p in probes[iid].items() if not p.records_portable}
                for shard, iid in asked.items()}

    async def restore(
        self, restore_id: str, root: str, sources: dict[str, dict[str, dict[str, list[str]]]],
        source_checkpoint_id: str, replay: frozenset[str] = frozenset(),
    ) -> dict[str, list[str]]:
        """Each running replica of ``sources`` installs what it is given (``sources[target][source][server]``:
        its own saved episodes, and those of vanished replicas of its shard, read from their directories,
        docs/design.md §5.7); those in ``replay`` are installed for replay (their model server only, §4.8).
        Returns per instance the new keys RL continues (the agents' restored ones, and the replayed)."""
        deadline = time.time() + self.prepare_timeout_s
        unknown = sorted(set(sources) - set(self.instance_ids))
        if unknown:
            raise RuntimeError(f"restore plan names Gym instances that are not running: {unknown}")
        calls = {}
        for iid, by_source in sources.items():
            order = sorted(by_source, key=lambda s: (s != iid, s))  # its own directory first
            dirs = [str(_replica_dir(source, root)) for source in order]
            scope: dict[str, list[EpisodeId]] = {}
            for source in order:
                for name, keys in by_source[source].items():
                    scope.setdefault(name, []).extend(EpisodeId.from_capture_key(k) for k in keys)
            replayed = [e for eps in scope.values() for e in eps if e.capture_key in replay]
            calls[iid] = self._send(iid, RestoreCall(
                checkpoint_id=restore_id, deadline_ts=deadline, checkpoint_dir=dirs[0], source_dirs=dirs[1:],
                episode_ids=scope, source_checkpoint_id=source_checkpoint_id,
                replay_episode_ids=list({e.capture_key: e for e in replayed}.values())))
        try:
            return await self._collect("restore", calls, deadline)
        finally:
            await self.resume(restore_id, sorted(calls))  # only those it asked: others may be in a pause


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def _replica_dir(instance_id: str, root: str) -> Path:
    """Where ``<shard>/replica-<i>`` wrote under ``root``, whether or not it runs now."""
    shard, _, index = instance_id.rpartition("/replica-")
    return GymCheckpointInstance(shard, int(index)).checkpoint_dir(root)
