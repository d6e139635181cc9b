"""``ParticipantControlPlane``: the checkpoint control routes of one Gym server (docs/design.md §4.4).

The participant knows how to close, report, export and install; the control plane composes
everything around it, one module per concern: ``http`` (auth, body cap, parsing, error replies),
``phases`` (the phase table, fencing, stored replies), ``lease`` (the lease and its watcher),
``scope`` (owned background work), ``staging`` (the capture and ``persist``), ``commit`` and
``restore`` (the work behind those routes).

Every operation that changes state runs under one lock. Slow work does not hold it: a commit's
export and write and a persist's write run as jobs of a ``TaskScope`` (the checkpoint's, from
prepare to resume or lease expiry; the capture's, until a newer capture), and the request waits
for the job outside the lock, so status, renew and resume are never stuck behind a disk. A job
takes the lock again only for the step that moves the phase. A job survives the request that
started it (a dropped connection); a retry gets its reply or its error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Callable, Hashable

from aiohttp import web

from gym_patches.checkpoint.control.commit import export_and_write, refuse_unready
from gym_patches.checkpoint.control.http import MAX_CONTROL_BODY_BYTES, ControlHttp
from gym_patches.checkpoint.control.lease import Lease, LeaseWatcher
from gym_patches.checkpoint.control.phases import PhaseMachine
from gym_patches.checkpoint.control.restore import read_selected
from gym_patches.checkpoint.control.scope import Job, TaskScope
from gym_patches.checkpoint.control.staging import NewestCapture, StagedCapture, take_capture
from gym_patches.checkpoint.errors import CheckpointError
from gym_patches.checkpoint.identity import EpisodeId
from gym_patches.checkpoint.participant import CheckpointParticipant
from gym_patches.checkpoint.storage import StorageWriter
from gym_patches.checkpoint.wire import (
    CommitReply,
    CommitRequest,
    ForgetReply,
    ForgetRequest,
    PersistRequest,
    Phase,
    PrepareReply,
    PrepareRequest,
    RenewReply,
    RenewRequest,
    RestartOnlyPolicy,
    RestoreReply,
    RestoreRequest,
    ResumeReply,
    ResumeRequest,
    RetireReply,
    RetireRequest,
    StatusReply,
    dump,
)
from gym_patches.utils.collector import CollectorHold
from gym_patches.utils.pacing import TurnPacer

logger = logging.getLogger(__name__)


def _keys(episodes: list[EpisodeId] | None) -> tuple[str, ...] | None:
    return None if episodes is None else tuple(sorted({e.capture_key for e in episodes}))


def _aborted(op: str, checkpoint_id: str) -> CheckpointError:
    return CheckpointError(f"{op} for {checkpoint_id!r} was aborted", code="stale_checkpoint")


class ParticipantControlPlane:
    """Serves ``/ng-control/v1/checkpoint/*`` for one participant."""

    def __init__(
        self,
        participant: CheckpointParticipant,
        *,
        instance: str,
        auth_token: str,
        writer: StorageWriter,
        lease_grace_seconds: float = 600.0,
        clock: Callable[[], float] = time.time,
        max_body_bytes: int = MAX_CONTROL_BODY_BYTES,
        pacer: TurnPacer | None = None,
    ):
        if not isinstance(participant, CheckpointParticipant):
            raise TypeError(f"participant must be a CheckpointParticipant, got {type(participant).__name__}")
        if not isinstance(instance, str) or not instance:
            raise ValueError("instance must be a non-empty string")
        self.participant = participant
        self.instance = instance
        self.writer = writer  # every file a commit or a persist writes (docs/design.md §4.7)
        self._http = ControlHttp(instance=instance, auth_token=auth_token, max_body_bytes=max_body_bytes,
                                 clock=clock)
        self._lease = Lease(lease_grace_seconds, clock)
        self._watcher = LeaseWatcher(self._lease, self._expire, instance)
        self._phases = PhaseMachine()
        self._lock = asyncio.Lock()
        self._scope: TaskScope | None = None  # the active checkpoint's jobs, from prepare (or restore) to reopen
        self._captures = NewestCapture()  # of the last ``capture`` prepare; owns its persist write
        self._closed = False  # admission closed by us, not yet reopened
        # (restart_only_policy, capture, cut, cut_rollouts) of the running prepare
        self._prepare_args: tuple[str, bool, bool, frozenset[str] | None] | None = None
        self._reported_unsaved: frozenset[str] = frozenset()  # in the prepared reply: a commit refuses them
        self._collector = CollectorHold()  # held while prepared: no full collection inside the pause
        # The server's pacer: held from close to reopen, so the work a checkpoint does not wait for
        # takes short turns while it is in progress (docs/design.md §4.5, "Paced turns").
        self._pacer = pacer

    # -- public state ------------------------------------------------------
    @property
    def phase(self) -> Phase:
        return self._phases.phase

    @property
    def checkpoint_id(self) -> str | None:
        return self._phases.checkpoint_id

    @property
    def lease_expires_at(self) -> float | None:
        return self._lease.expires_at

    def status(self) -> dict[str, Any]:
        """The ``GET status`` body: control state, readiness and ``status_extra()``."""
        reply = StatusReply(
            kind=self.participant.kind,
            instance=self.instance,
            phase=self.phase,
            checkpoint_id=self.checkpoint_id,
            lease_expires_at=self.lease_expires_at,
            report=self.participant.readiness(),
            records_portable=self.participant.records_portable,
        )
        body = dict(self.participant.status_extra())
        body.update(dump(reply))  # control fields win over a clashing extra
        return body

    # -- wiring ------------------------------------------------------------
    def install(self, app: web.Application) -> None:
        """Add the routes and the start/stop hooks of the lease watcher."""
        self._http.install(app, self.status, {
            "prepare": (PrepareRequest, self._prepare),
            "renew": (RenewRequest, self._renew),
            "retire": (RetireRequest, self._retire),
            "commit": (CommitRequest, self._commit),
            "persist": (PersistRequest, self._persist),
            "forget": (ForgetRequest, self._forget),
            "restore": (RestoreRequest, self._restore),
            "resume": (ResumeRequest, self._resume),
        })
        app.on_startup.append(lambda _: self.start())
        app.on_cleanup.append(lambda _: self.stop())

    async def start(self) -> None:
        """Start the lease watcher (idempotent)."""
        self._watcher.start()

    async def stop(self) -> None:
        """Stop the lease watcher and every job still running; nothing of ours is left running."""
        self._collector.release()
        await self._watcher.stop()
        scope, self._scope = self._scope, None
        if scope is not None:
            await scope.close("the server stopping")
        await self._captures.close("the server stopping")  # a write stops before it publishes
        await self.participant.stop()  # what the participant owns (the model's cut pins)

    # -- operations ----------------------------------------------------------
    async def _prepare(self, req: PrepareRequest) -> dict[str, Any]:
        cut_rollouts = None if req.cut_rollouts is None else frozenset(req.cut_rollouts)
        cid, args = req.checkpoint_id, (req.restart_only_policy, req.capture, req.cut, cut_rollouts)
        async with self._lock:
            stored = self._replay(cid, "prepare", args)
            if stored is not None:
                return stored
            self._phases.admit(cid, "prepare")
            if self.phase == "preparing" and self._prepare_args != args:
                assert self._prepare_args is not None
                raise CheckpointError(
                    f"prepare for {cid!r} is running with restart_only_policy {self._prepare_args[0]!r}, "
                    f"capture {self._prepare_args[1]}, cut {self._prepare_args[2]}"
                    + ("" if self._prepare_args[3] is None else f" of {len(self._prepare_args[3])} rollouts"),
                    code="checkpoint_conflict",
                )
            if self.phase == "idle":
                await self._close_admission(cid, req.restart_only_policy, args)
                if req.cut:  # as admission closes: never fails, never blocks past its own timeout
                    await self.participant.take_cut(cut_rollouts)  # only prefix-level rollouts' calls
            self._lease.extend(req.deadline_ts)
        await self._wait_ready(cid, req.deadline_ts)  # outside the lock: a resume may interleave
        async with self._lock:
            stored = self._replay(cid, "prepare", args)
            if stored is not None:  # a concurrent retry finished first
                return stored
            if not self._phases.is_at(cid, "preparing"):
                raise _aborted("prepare", cid)
            report = self.participant.readiness()
            if not report.ready:
                return dump(PrepareReply(phase="preparing", report=report))
            report.ended = self.participant.ended_runs()  # once, in the prepared reply only
            self._collector.hold()  # released by resume or lease expiry (``_reopen``)
            captured: StagedCapture | None = None
            if req.capture:
                try:
                    captured = await take_capture(self.participant, self.instance, cid, report.unsaved)
                except BaseException:
                    self._collector.release()
                    raise  # still preparing: a retry captures again, a resume reopens
                await self._captures.replace(captured)  # the newest capture replaces any older one
            self._phases.move("ready", cid)
            self._reported_unsaved = frozenset(report.unsaved)
            reply = dump(PrepareReply(
                phase="prepared", report=report,
                captured=None if captured is None else captured.keys,
                captured_bytes=0 if captured is None else captured.nbytes,
                cut=self.participant.cut_summary() if req.cut else None,
            ))
            self._phases.remember(cid, "prepare", args, reply)
            return reply

    async def _close_admission(self, cid: str, policy: RestartOnlyPolicy,
                               args: tuple[str, bool, bool, frozenset[str] | None]) -> None:
        """Idle -> preparing: open the checkpoint's scope and close admission (undone if that fails)."""
        self.participant.policy = policy
        self._phases.move("close", cid)
        self._prepare_args = args
        self._scope = TaskScope(f"checkpoint {cid!r}", self.instance)
        self._closed = True
        if self._pacer is not None:
            self._pacer.hold()
        try:
            await self.participant.close_admission(policy)
        except BaseException:
            with contextlib.suppress(Exception):
                await self.participant.open_admission()
            self._closed = False
            if self._pacer is not None:
                self._pacer.release()
            self._phases.reopen()
            self._prepare_args, self._scope = None, None  # nothing was started in it
            raise

    async def _wait_ready(self, checkpoint_id: str, deadline_ts: float) -> None:
        while self._phases.is_at(checkpoint_id, "preparing"):
            if self.participant.is_ready():  # cheap; the report is built once, under the lock
                return
            remaining = deadline_ts - self._lease.clock()
            if remaining <= 0:
                return
            await self.participant.wait_changed(min(remaining, 1.0))

    async def _renew(self, req: RenewRequest) -> dict[str, Any]:
        async with self._lock:
            self._phases.admit(req.checkpoint_id, "renew")
            self._lease.extend(req.deadline_ts)
            return dump(RenewReply(lease_expires_at=self.lease_expires_at))

    async def _retire(self, req: RetireRequest) -> dict[str, Any]:
        cid, args = req.checkpoint_id, _keys(req.episode_ids)
        async with self._lock:
            stored = self._replay(cid, "retire", args)
            if stored is not None:
                return stored
            self._phases.admit(cid, "retire")
            retired = await self.participant.retire(list(req.episode_ids))
            if self.phase != "idle":  # an idle server has nothing a lease could reopen
                self._lease.extend(req.deadline_ts)
            reply = dump(RetireReply(retired=list(retired)))
            self._phases.remember(cid, "retire", args, reply)
            return reply

    async def _commit(self, req: CommitRequest) -> dict[str, Any]:
        """Export and write inside the pause, as a job of the checkpoint: retries share it."""
        cid, scope = req.checkpoint_id, _keys(req.episode_ids)
        args = (req.checkpoint_dir, scope)
        async with self._lock:
            stored = self._replay(cid, "commit", args)
            if stored is not None:
                return stored
            self._phases.admit(cid, "commit")
            assert self._scope is not None, "a prepared checkpoint has a scope"
            job = self._scope.get("commit")
            if job is not None and job.args != args:
                how = "is running" if job.running else "already ran"
                raise CheckpointError(f"commit for {cid!r} {how} with other arguments", code="checkpoint_conflict")
            if job is None:
                refuse_unready(self.instance, self.participant.readiness(), scope, self._reported_unsaved)
                job = self._scope.spawn("commit", f"commit for {cid!r}", args,
                                        lambda job: self._run_commit(job, req))
            self._lease.extend(req.deadline_ts)
        return await job.result()  # a dropped connection does not stop the job; a retry gets its outcome

    async def _run_commit(self, job: Job[dict[str, Any]], req: CommitRequest) -> dict[str, Any]:
        cid = req.checkpoint_id
        manifest, keys, cut_tokens = await export_and_write(job, self.participant, self.instance, req,
                                                            self.writer, self._reported_unsaved)
        async with self._lock:
            if job.stop.is_set() or not self._phases.is_at(cid, "prepared"):
                raise _aborted("commit", cid)
            reply = dump(CommitReply(phase="committed", manifest=manifest, episode_ids=keys, cut_tokens=cut_tokens))
            self._phases.move("commit", cid)
            self._phases.remember(cid, "commit", job.args, reply)
        return reply

    async def _persist(self, req: PersistRequest) -> dict[str, Any]:
        """Write the scope's records from the copy the ``capture`` prepare of ``checkpoint_id`` took
        (also after resume), as a job of that capture: retries share one write.

        Only the newest capture is kept: an older id answers 409 ``stale_checkpoint``. The first
        call fixes the arguments (others: ``checkpoint_conflict``). A failed write answers its
        error (422 for a disk error) to every retry: that snapshot failed, and the next one
        writes anew under its own id.
        """
        scope = _keys(req.episode_ids) or ()
        async with self._lock:
            staged = self._captures.of(req.checkpoint_id)
            job = staged.persist(self.participant.kind, self.instance, req.checkpoint_dir, scope, self.writer)
        return await job.result()

    async def _forget(self, req: ForgetRequest) -> dict[str, Any]:
        """Drop what is kept about finished rollouts; idle only (no checkpoint can be holding them)."""
        async with self._lock:
            self._phases.admit(req.checkpoint_id, "forget")
            return dump(ForgetReply(forgotten=self.participant.forget(set(req.rollout_ids))))

    async def _restore(self, req: RestoreRequest) -> dict[str, Any]:
        cid = req.checkpoint_id
        wanted = _keys(req.episode_ids) or ()
        replay = _keys(req.replay_episode_ids) or ()
        args = (req.checkpoint_dir, wanted, req.source_checkpoint_id, tuple(req.source_dirs), replay)
        async with self._lock:
            stored = self._replay(cid, "restore", args)
            if stored is not None:
                return stored
            self._phases.admit(cid, "restore")
            selected = await asyncio.to_thread(read_selected, self.participant.kind, self.instance, req, set(wanted))
            restored = await (self.participant.install(selected, replay=frozenset(replay)) if replay
                              else self.participant.install(selected))
            self._phases.move("restore", cid)
            self._scope = TaskScope(f"checkpoint {cid!r}", self.instance)  # closed by its resume, like any
            self._lease.extend(req.deadline_ts)
            reply = dump(RestoreReply(phase="restored", source_checkpoint_id=req.source_checkpoint_id,
                                      restored=list(restored)))
            self._phases.remember(cid, "restore", args, reply)
            return reply

    async def _resume(self, req: ResumeRequest) -> dict[str, Any]:
        cid = req.checkpoint_id
        async with self._lock:
            if self._phases.is_fenced(cid):
                return dump(ResumeReply(phase="idle", idempotent=True))
            if self.phase == "idle" and not self._closed:
                self._phases.fence(cid)  # never prepared: nothing to reopen, but the id is now spent
                return dump(ResumeReply(phase="idle", idempotent=True))
            if self.checkpoint_id is not None and self.checkpoint_id != cid:
                raise CheckpointError(
                    f"resume for {cid!r} refused: checkpoint {self.checkpoint_id!r} is active",
                    code="checkpoint_conflict",
                )
            await self._reopen("a resume")
            self._phases.fence(cid)
            return dump(ResumeReply(phase="idle", idempotent=False))

    async def _expire(self) -> None:
        """The lease watcher's call: reopen if the lease is still past (not renewed meanwhile)."""
        async with self._lock:
            if not self._lease.expired():
                return
            cid = self.checkpoint_id
            logger.warning("checkpoint control %s: lease of %r expired in phase %s; reopening",
                           self.instance, cid, self.phase)
            await self._reopen("lease expiry")
            if cid is not None:
                self._phases.fence(cid)

    # -- helpers -------------------------------------------------------------
    def _replay(self, checkpoint_id: str, op: str, args: Hashable) -> dict[str, Any] | None:
        self._phases.check_stale(checkpoint_id)
        return self._phases.replay(checkpoint_id, op, args)

    async def _reopen(self, reason: str) -> None:
        """Close the checkpoint's scope (a running commit stops before it publishes), reopen
        admission, go idle. Caller holds the lock."""
        scope, self._scope = self._scope, None
        if scope is not None:
            await scope.close(reason)
        if self._closed:
            await self.participant.open_admission()
            self._closed = False
            if self._pacer is not None:
                self._pacer.release()
        self._collector.release()
        self._phases.reopen()
        self._lease.clear()
        self._prepare_args = None
        self.participant.notify_changed()  # wake a prepare waiting for readiness
