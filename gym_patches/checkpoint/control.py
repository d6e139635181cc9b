"""Checkpoint control routes of one Gym server (DESIGN §3.3).

The participant knows how to close, report, export and install; this module
owns everything around it: bearer auth, phases, fencing of old checkpoint
ids, idempotent retries, the lease that reopens a server whose controller
died, and writing/reading the store.

Status codes follow one rule (``gym_patches.checkpoint.errors``): 409 when the
request is well formed but the checkpoint state refuses it; 422
``invalid_request`` when the request itself is wrong (bad body or field, or a
``deadline_ts`` that is not in the future on any route but ``resume``); 413
``payload_too_large`` for a body over ``max_body_bytes``; 401 without the
token; 500 when a participant fails unexpectedly. A 4xx never changes state.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import time
from collections import OrderedDict
from typing import Any, Awaitable, Callable, Hashable

from aiohttp import web
from pydantic import BaseModel, ValidationError

from gym_patches.checkpoint.errors import CheckpointError, CheckpointStoreError
from gym_patches.checkpoint.identity import EpisodeId
from gym_patches.checkpoint.participant import CheckpointParticipant, Record
from gym_patches.checkpoint.records import CapturedRecord, RecordEncodeError, encode_record, frozen_copy, record_key
from gym_patches.checkpoint.store import (
    EncodedRecords,
    WriteStopped,
    read_participant_state,
    write_participant_state,
)
from gym_patches.checkpoint.wire import (
    CHECKPOINT_ROUTE_PREFIX,
    CheckpointRequest,
    CommitReply,
    CommitRequest,
    Phase,
    PrepareReply,
    PrepareRequest,
    RenewReply,
    RenewRequest,
    ForgetReply,
    ForgetRequest,
    PersistReply,
    PersistRequest,
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

logger = logging.getLogger(__name__)

RESUMED_IDS_KEPT = 64
STORED_RESULTS_KEPT = 256
_NON_IDLE: frozenset[str] = frozenset({"preparing", "prepared", "committed", "restored"})
_INTERNAL_ERROR = "internal_error"  # 500: a participant raised something that is not a CheckpointError
# Above the largest valid request (MAX_EPISODES_PER_REQUEST ids of the longest form, ~25 MB),
# below the server's 64 MiB aiohttp cap.
MAX_CONTROL_BODY_BYTES = 32 * 1024 * 1024
_BODY_CHUNK = 256 * 1024


def _keys(episodes: list[EpisodeId] | None) -> tuple[str, ...] | None:
    return None if episodes is None else tuple(sorted({e.capture_key for e in episodes}))


class _CommitWork:
    """One running export+write, shared by every retry of the same commit."""

    def __init__(self, checkpoint_id: str, args: Hashable):
        self.checkpoint_id = checkpoint_id
        self.args = args
        self.stop = False
        self.writing = False
        self.task: asyncio.Task[dict[str, Any]] | None = None


class _Staged:
    """What a ``capture`` prepare copied: every exportable session's record, by capture key (an
    immutable record as it is, any other already encoded). ``persist`` writes a scope's records
    from it after resume; nothing running later can change it."""

    def __init__(self, checkpoint_id: str, entries: dict[str, list[Record | bytes]], nbytes: int,
                 fill: Callable[[EpisodeId], Record | None] | None, unsaved: frozenset[str]):
        self.checkpoint_id = checkpoint_id
        self.entries: dict[str, list[Record | bytes]] | None = entries  # None once written
        self.nbytes = nbytes
        self.fill = fill
        self.unsaved = unsaved
        self.args: Hashable | None = None  # the persist's (checkpoint_dir, scope), fixed by its first call
        self.task: asyncio.Task[dict[str, Any]] | None = None

    def select(self, scope: tuple[str, ...]) -> tuple[list[str], EncodedRecords]:
        """The scope's records as JSONL lines (in key order), and the keys that have any."""
        assert self.entries is not None
        keys: list[str] = []
        lines: list[bytes] = []
        for key in scope:
            found = self.entries.get(key)
            if found is None and self.fill is not None:
                record = self.fill(EpisodeId.from_capture_key(key))
                found = None if record is None else [record]
            if not found:
                continue
            keys.append(key)
            for entry in found:
                if type(entry) is bytes:
                    lines.append(entry)
                    continue
                try:
                    lines.append(encode_record(entry))
                except RecordEncodeError as exc:
                    raise CheckpointStoreError(f"the record of {key} is not JSON-serialisable: {exc}") from None
        return keys, EncodedRecords(lines)


class ParticipantControlPlane:
    """Serves ``/ng-control/v1/checkpoint/*`` for one participant."""

    def __init__(
        self,
        participant: CheckpointParticipant,
        *,
        instance: str,
        auth_token: str,
        lease_grace_seconds: float = 600.0,
        clock: Callable[[], float] = time.time,
        max_body_bytes: int = MAX_CONTROL_BODY_BYTES,
    ):
        if not isinstance(participant, CheckpointParticipant):
            raise TypeError(f"participant must be a CheckpointParticipant, got {type(participant).__name__}")
        if not isinstance(instance, str) or not instance:
            raise ValueError("instance must be a non-empty string")
        if not isinstance(auth_token, str) or not auth_token:
            raise ValueError(f"checkpoint control of {instance!r} needs a non-empty auth_token")
        if not math.isfinite(lease_grace_seconds) or lease_grace_seconds < 0:
            raise ValueError(f"lease_grace_seconds must be finite and >= 0, got {lease_grace_seconds!r}")
        if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be a positive integer, got {max_body_bytes!r}")
        self.participant = participant
        self.instance = instance
        self._max_body = max_body_bytes
        self._token = auth_token.encode("utf-8")
        self._grace = float(lease_grace_seconds)
        self._clock = clock
        self._phase: Phase = "idle"
        self._checkpoint_id: str | None = None
        self._lease_expires_at: float | None = None
        self._closed = False  # admission closed by us, not yet reopened
        self._prepare_args: tuple[str, bool] | None = None  # (restart_only_policy, capture) of the running prepare
        self._lock = asyncio.Lock()
        self._lease_changed = asyncio.Event()
        self._resumed: OrderedDict[str, None] = OrderedDict()
        self._results: OrderedDict[tuple[str, str], tuple[Hashable, dict[str, Any]]] = OrderedDict()
        self._commit: _CommitWork | None = None
        self._staged: _Staged | None = None  # the newest capture (a ``capture`` prepare); one at a time
        self._watcher: asyncio.Task[None] | None = None
        self._collector = CollectorHold()  # held while prepared: no full collection inside the pause

    # -- public state ------------------------------------------------------
    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def checkpoint_id(self) -> str | None:
        return self._checkpoint_id

    @property
    def lease_expires_at(self) -> float | None:
        return self._lease_expires_at

    # -- wiring ------------------------------------------------------------
    def install(self, app: web.Application) -> None:
        """Add the routes and the start/stop hooks of the lease watcher."""
        p = CHECKPOINT_ROUTE_PREFIX
        app.router.add_get(f"{p}/status", self._status_route)
        routes: dict[str, tuple[type[CheckpointRequest], Callable[[Any], Awaitable[dict[str, Any]]]]] = {
            "prepare": (PrepareRequest, self._prepare),
            "renew": (RenewRequest, self._renew),
            "retire": (RetireRequest, self._retire),
            "commit": (CommitRequest, self._commit_op),
            "persist": (PersistRequest, self._persist),
            "forget": (ForgetRequest, self._forget),
            "restore": (RestoreRequest, self._restore),
            "resume": (ResumeRequest, self._resume),
        }
        for op, (model, handler) in routes.items():
            app.router.add_post(f"{p}/{op}", self._route(op, model, handler))
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)

    async def start(self) -> None:
        """Start the lease watcher (idempotent)."""
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.create_task(self._watch_lease(), name=f"checkpoint-lease:{self.instance}")

    async def stop(self) -> None:
        """Stop the lease watcher and any commit still running."""
        self._collector.release()
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        await self._stop_commit()
        staged, self._staged = self._staged, None
        if staged is not None and staged.task is not None and not staged.task.done():
            staged.task.cancel()  # the store's temp-file-and-rename write never publishes half a file
            await asyncio.gather(staged.task, return_exceptions=True)

    async def _on_startup(self, _: web.Application) -> None:
        await self.start()

    async def _on_cleanup(self, _: web.Application) -> None:
        await self.stop()

    # -- HTTP plumbing -----------------------------------------------------
    def _authorized(self, request: web.Request) -> bool:
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        try:
            given = token.strip().encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            return False
        return hmac.compare_digest(given, self._token)

    @staticmethod
    def _error(exc: CheckpointError) -> web.Response:
        return web.json_response(exc.to_body(), status=exc.status)

    def _unauthorized(self, request: web.Request) -> web.Response:
        logger.warning("checkpoint control %s: rejected %s %s (bad or missing bearer token)",
                       self.instance, request.method, request.path)
        return self._error(CheckpointError("missing or invalid bearer token", code="unauthorized"))

    async def _status_route(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self._unauthorized(request)
        try:
            return web.json_response(self.status())
        except Exception as exc:
            logger.exception("checkpoint control %s: status failed", self.instance)
            body = {"error": {"code": _INTERNAL_ERROR, "detail": f"status failed: {type(exc).__name__}: {exc}"}}
            return web.json_response(body, status=500)

    def status(self) -> dict[str, Any]:
        """The ``GET status`` body: control state, readiness and ``status_extra()``."""
        reply = StatusReply(
            kind=self.participant.kind,
            instance=self.instance,
            phase=self._phase,
            checkpoint_id=self._checkpoint_id,
            lease_expires_at=self._lease_expires_at,
            report=self.participant.readiness(),
        )
        body = dict(self.participant.status_extra())
        body.update(dump(reply))  # control fields win over a clashing extra
        return body

    def _route(
        self,
        op: str,
        model: type[CheckpointRequest],
        handler: Callable[[Any], Awaitable[dict[str, Any]]],
    ) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def route(request: web.Request) -> web.Response:
            if not self._authorized(request):
                return self._unauthorized(request)
            try:
                req = await self._parse(request, op, model)
                if op != "resume":
                    self._check_deadline(op, req.deadline_ts)
                return web.json_response(await handler(req))
            except CheckpointError as exc:
                return self._error(exc)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a participant bug: report it, keep serving
                logger.exception("checkpoint control %s: %s failed", self.instance, op)
                body = {"error": {"code": _INTERNAL_ERROR, "detail": f"{op} failed: {type(exc).__name__}: {exc}"}}
                return web.json_response(body, status=500)

        route.__name__ = f"checkpoint_{op}"
        return route

    def _check_deadline(self, op: str, deadline_ts: float) -> None:
        """A deadline already past would open a lease that has expired: refuse it.
        ``resume`` is exempt: reopening is always safe, also after a missed deadline."""
        late = self._clock() - deadline_ts
        if late >= 0:
            raise CheckpointError(
                f"{op}: invalid request: deadline_ts: must be in the future "
                f"(it passed {late:.3f}s ago by this server's clock)",
                code="invalid_request",
            )

    async def _read_body(self, request: web.Request, op: str) -> bytes:
        """The body, or 413 past ``max_body_bytes`` (read in chunks, never whole)."""
        cap = self._max_body
        too_large = CheckpointError(f"{op}: request body is over the {cap}-byte limit", code="payload_too_large")
        if request.content_length is not None and request.content_length > cap:
            raise too_large  # aiohttp discards the unread rest before closing
        chunks: list[bytes] = []
        size = 0
        while True:
            chunk = await request.content.read(_BODY_CHUNK)
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > cap:
                raise too_large
            chunks.append(chunk)

    async def _parse(self, request: web.Request, op: str, model: type[BaseModel]) -> Any:
        raw = await self._read_body(request, op)
        try:
            data = json.loads(raw) if raw else None
        except (ValueError, UnicodeDecodeError):
            raise CheckpointError(f"{op}: request body is not valid JSON", code="invalid_request") from None
        if not isinstance(data, dict):
            raise CheckpointError(f"{op}: request body must be a JSON object", code="invalid_request")
        try:
            # strict: a deadline of "12" or true is a caller bug, not a number.
            return model.model_validate(data, strict=True)
        except ValidationError as exc:
            # loc + msg only: never echo input values back.
            fields = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '<body>'}: {e['msg']}" for e in exc.errors()
            )
            raise CheckpointError(f"{op}: invalid request: {fields}", code="invalid_request") from None

    # -- bookkeeping -------------------------------------------------------
    def _check_stale(self, checkpoint_id: str) -> None:
        if checkpoint_id in self._resumed:
            raise CheckpointError(f"checkpoint {checkpoint_id!r} was already resumed", code="stale_checkpoint")

    def _stored(self, checkpoint_id: str, op: str, args: Hashable) -> dict[str, Any] | None:
        entry = self._results.get((checkpoint_id, op))
        if entry is None:
            return None
        stored_args, reply = entry
        if stored_args != args:
            raise CheckpointError(
                f"{op} for checkpoint {checkpoint_id!r} was already done with other arguments",
                code="checkpoint_conflict",
            )
        return reply

    def _store(self, checkpoint_id: str, op: str, args: Hashable, reply: dict[str, Any]) -> None:
        self._results[(checkpoint_id, op)] = (args, reply)
        self._results.move_to_end((checkpoint_id, op))
        while len(self._results) > STORED_RESULTS_KEPT:
            self._results.popitem(last=False)

    def _admit(self, checkpoint_id: str, op: str, allowed: frozenset[str] | set[str]) -> None:
        self._check_stale(checkpoint_id)
        if self._phase != "idle" and self._checkpoint_id != checkpoint_id:
            raise CheckpointError(
                f"{op} for {checkpoint_id!r} refused: checkpoint {self._checkpoint_id!r} is active",
                code="checkpoint_conflict",
            )
        if self._phase not in allowed:
            hint = "; resume first" if op == "retire" else ""
            raise CheckpointError(
                f"{op} needs phase {' or '.join(sorted(allowed))}, but phase is {self._phase}{hint}",
                code="invalid_phase",
            )

    def _extend_lease(self, deadline_ts: float) -> None:
        lease = deadline_ts + self._grace
        if self._lease_expires_at is None or lease > self._lease_expires_at:
            self._lease_expires_at = lease
            self._lease_changed.set()

    def _fence(self, checkpoint_id: str) -> None:
        self._resumed[checkpoint_id] = None
        self._resumed.move_to_end(checkpoint_id)
        while len(self._resumed) > RESUMED_IDS_KEPT:
            self._resumed.popitem(last=False)
        for key in [k for k in self._results if k[0] == checkpoint_id]:
            del self._results[key]

    async def _stop_commit(self) -> None:
        work, self._commit = self._commit, None
        if work is None or work.task is None or work.task.done():
            return
        work.stop = True
        if not work.writing:  # the store write checks ``stop`` itself and cleans up
            work.task.cancel()
        await asyncio.wait({work.task})

    async def _reopen(self) -> None:
        """Stop a running commit, reopen admission, go idle. Caller holds the lock."""
        await self._stop_commit()
        if self._closed:
            await self.participant.open_admission()
            self._closed = False
        self._collector.release()
        self._phase = "idle"
        self._checkpoint_id = None
        self._lease_expires_at = None
        self._prepare_args = None
        self._lease_changed.set()
        self.participant.notify_changed()  # wake a prepare waiting for readiness

    # -- operations ----------------------------------------------------------
    async def _prepare(self, req: PrepareRequest) -> dict[str, Any]:
        cid, args = req.checkpoint_id, (req.restart_only_policy, req.capture)
        async with self._lock:
            self._check_stale(cid)
            stored = self._stored(cid, "prepare", args)
            if stored is not None:
                return stored
            self._admit(cid, "prepare", {"idle", "preparing"})
            if self._phase == "preparing" and self._prepare_args != args:
                raise CheckpointError(
                    f"prepare for {cid!r} is running with restart_only_policy {self._prepare_args[0]!r}, "
                    f"capture {self._prepare_args[1]}",
                    code="checkpoint_conflict",
                )
            if self._phase == "idle":
                self.participant.policy = req.restart_only_policy
                self._phase, self._checkpoint_id = "preparing", cid
                self._prepare_args = args
                self._closed = True
                try:
                    await self.participant.close_admission(req.restart_only_policy)
                except BaseException:
                    with contextlib.suppress(Exception):
                        await self.participant.open_admission()
                    self._closed = False
                    self._phase, self._checkpoint_id, self._prepare_args = "idle", None, None
                    raise
            self._extend_lease(req.deadline_ts)
        await self._wait_ready(cid, req.deadline_ts)  # outside the lock: a resume may interleave
        async with self._lock:
            self._check_stale(cid)
            if self._checkpoint_id != cid or self._phase not in ("preparing", "prepared", "committed"):
                raise CheckpointError(f"prepare for {cid!r} was aborted", code="stale_checkpoint")
            stored = self._stored(cid, "prepare", args)
            if stored is not None:  # a concurrent retry finished first
                return stored
            report = self.participant.readiness()
            if not report.ready:
                return dump(PrepareReply(phase="preparing", report=report))
            self._collector.hold()  # released by resume or lease expiry (``_reopen``)
            captured: _Staged | None = None
            if req.capture:
                try:
                    captured = await self._capture(cid, report.unsaved)
                except BaseException:
                    self._collector.release()
                    raise  # still preparing: a retry captures again, a resume reopens
                self._staged = captured  # the newest capture replaces any older one
            self._phase = "prepared"
            reply = dump(PrepareReply(
                phase="prepared", report=report,
                captured=None if captured is None else sorted(captured.entries or ()),
                captured_bytes=0 if captured is None else captured.nbytes,
            ))
            self._store(cid, "prepare", args, reply)
            return reply

    async def _capture(self, checkpoint_id: str, unsaved: list[str]) -> _Staged:
        """Copy every exportable session's record now, while everything is held (on the loop: a
        thread would only wait on the GIL). A record of immutable values is kept as it is (its
        fragments are already bytes) and encoded by ``persist``; any other is encoded here. A
        ``CapturedRecord`` is that work done by the participant when its session came to rest. A
        record without a valid episode_id fails the prepare."""
        records = await self.participant.capture_records()
        fill = self.participant.scope_fill()
        entries: dict[str, list[Record | bytes]] = {}
        nbytes = 0
        for index, record in enumerate(records):
            if type(record) is CapturedRecord:  # checked and frozen by the participant, maybe long ago
                key, kept, size = record
                entries.setdefault(key, []).append(kept)
                nbytes += size
                continue
            key = record_key(record)
            if key is None:
                raise CheckpointError(f"{self.instance} exported record {index} without a valid episode_id")
            kept, size = frozen_copy(record)
            if kept is None:
                try:
                    kept = encode_record(record)
                except RecordEncodeError as exc:
                    raise CheckpointError(f"{self.instance} cannot capture record {index} ({key}): {exc}") from None
                size = len(kept)
            nbytes += size
            entries.setdefault(key, []).append(kept)
        return _Staged(checkpoint_id, entries, nbytes, fill, frozenset(unsaved))

    async def _wait_ready(self, checkpoint_id: str, deadline_ts: float) -> None:
        while self._checkpoint_id == checkpoint_id and self._phase == "preparing":
            if self.participant.readiness().ready:
                return
            remaining = deadline_ts - self._clock()
            if remaining <= 0:
                return
            await self.participant.wait_changed(min(remaining, 1.0))

    async def _renew(self, req: RenewRequest) -> dict[str, Any]:
        async with self._lock:
            self._admit(req.checkpoint_id, "renew", _NON_IDLE)
            self._extend_lease(req.deadline_ts)
            return dump(RenewReply(lease_expires_at=self._lease_expires_at))

    async def _retire(self, req: RetireRequest) -> dict[str, Any]:
        cid, args = req.checkpoint_id, _keys(req.episode_ids)
        async with self._lock:
            self._check_stale(cid)
            stored = self._stored(cid, "retire", args)
            if stored is not None:
                return stored
            self._admit(cid, "retire", {"idle", "restored"})
            retired = await self.participant.retire(list(req.episode_ids))
            if self._phase != "idle":  # an idle server has nothing a lease could reopen
                self._extend_lease(req.deadline_ts)
            reply = dump(RetireReply(retired=list(retired)))
            self._store(cid, "retire", args, reply)
            return reply

    async def _commit_op(self, req: CommitRequest) -> dict[str, Any]:
        cid, scope = req.checkpoint_id, _keys(req.episode_ids)
        args = (req.checkpoint_dir, scope)
        async with self._lock:
            self._check_stale(cid)
            stored = self._stored(cid, "commit", args)
            if stored is not None:
                return stored
            self._admit(cid, "commit", {"prepared", "committed"})
            work = self._commit
            if work is not None and work.checkpoint_id == cid and work.task is not None and not work.task.done():
                if work.args != args:
                    raise CheckpointError(
                        f"commit for {cid!r} is running with other arguments", code="checkpoint_conflict"
                    )
            else:
                report = self.participant.readiness()
                if not report.ready:
                    raise CheckpointError(
                        f"{self.instance} is no longer ready (blockers: {report.blockers})", code="invalid_phase"
                    )
                unsaved = set(report.unsaved)
                in_scope = sorted(unsaved if scope is None else unsaved.intersection(scope))
                if in_scope:
                    raise CheckpointError(
                        f"{self.instance} cannot save {in_scope[:10]} ({len(in_scope)} unsaved in scope); "
                        "commit only the continued episodes",
                        code="restart_in_scope",
                    )
                work = _CommitWork(cid, args)
                work.task = asyncio.create_task(self._run_commit(work, req), name=f"checkpoint-commit:{cid}")
                # retrieve the outcome even if every waiting request went away
                work.task.add_done_callback(lambda t: t.cancelled() or t.exception())
                self._commit = work
            self._extend_lease(req.deadline_ts)
        assert work.task is not None
        try:
            return await asyncio.shield(work.task)  # a dropped connection does not stop the commit
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if work.task.cancelled() and not (me is not None and me.cancelling()):
                raise CheckpointError(f"commit for {cid!r} was aborted by a resume", code="stale_checkpoint") from None
            raise

    async def _run_commit(self, work: _CommitWork, req: CommitRequest) -> dict[str, Any]:
        try:
            scope = None if req.episode_ids is None else list(req.episode_ids)
            records = await self.participant.export(scope)
            keys = self._exported_keys(records, None if scope is None else {e.capture_key for e in scope})
            if work.stop:
                raise CheckpointError(f"commit for {work.checkpoint_id!r} was aborted", code="stale_checkpoint")
            work.writing = True
            try:
                manifest = await asyncio.to_thread(
                    write_participant_state,
                    req.checkpoint_dir,
                    self.participant.kind,
                    self.instance,
                    work.checkpoint_id,
                    records,
                    should_stop=lambda: work.stop,
                )
            except WriteStopped:
                raise CheckpointError(f"commit for {work.checkpoint_id!r} was aborted", code="stale_checkpoint") from None
            if work.stop or self._checkpoint_id != work.checkpoint_id or self._phase != "prepared":
                raise CheckpointError(f"commit for {work.checkpoint_id!r} was aborted", code="stale_checkpoint")
            reply = dump(CommitReply(phase="committed", manifest=manifest, episode_ids=keys))
            self._phase = "committed"
            self._store(work.checkpoint_id, "commit", work.args, reply)
            return reply
        finally:
            if self._commit is work:
                self._commit = None

    async def _forget(self, req: ForgetRequest) -> dict[str, Any]:
        """Drop what is kept about finished rollouts; idle only (no checkpoint can be holding them)."""
        async with self._lock:
            self._admit(req.checkpoint_id, "forget", {"idle"})
            return dump(ForgetReply(forgotten=self.participant.forget(set(req.rollout_ids))))

    async def _persist(self, req: PersistRequest) -> dict[str, Any]:
        """Write the scope's records from the copy the ``capture`` prepare of ``checkpoint_id`` took
        (also after resume; retries share one write).

        Only the newest capture is kept: an older id answers 409 ``stale_checkpoint``. The first
        call fixes the arguments (others: ``checkpoint_conflict``). A write failure answers 422 and
        the copy is kept, so a retry can write it again.
        """
        cid, scope = req.checkpoint_id, _keys(req.episode_ids) or ()
        args = (req.checkpoint_dir, scope)
        staged = self._staged
        if staged is None or staged.checkpoint_id != cid:
            raise CheckpointError(f"nothing captured for checkpoint {cid!r} (a newer capture replaced it, or its "
                                  "prepare did not capture)", code="stale_checkpoint")
        if staged.args is not None and staged.args != args:
            raise CheckpointError(f"persist for {cid!r} was already asked with other arguments",
                                  code="checkpoint_conflict")
        in_scope = sorted(staged.unsaved.intersection(scope))
        if in_scope:
            raise CheckpointError(
                f"{self.instance} cannot save {in_scope[:10]} ({len(in_scope)} unsaved in scope); "
                "persist only the continued episodes",
                code="restart_in_scope",
            )
        staged.args = args
        if staged.task is None or (staged.task.done() and (staged.task.cancelled() or staged.task.exception())):
            staged.task = asyncio.create_task(self._write_staged(staged, req.checkpoint_dir, scope),
                                              name=f"checkpoint-persist:{cid}")
            staged.task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return await asyncio.shield(staged.task)

    async def _write_staged(self, staged: _Staged, checkpoint_dir: str, scope: tuple[str, ...]) -> dict[str, Any]:
        def select_and_write() -> tuple[list[str], Any]:
            keys, encoded = staged.select(scope)
            return keys, write_participant_state(
                checkpoint_dir, self.participant.kind, self.instance, staged.checkpoint_id, encoded)

        keys, manifest = await asyncio.to_thread(select_and_write)
        staged.entries = None  # written: free the copy (retries get this reply)
        return dump(PersistReply(manifest=manifest, episode_ids=keys))

    def _exported_keys(self, records: list[Record], scope: set[str] | None) -> list[str]:
        keys: list[str] = []
        for index, record in enumerate(records):
            key = record_key(record)
            if key is None:
                raise CheckpointError(f"{self.instance} exported record {index} without a valid episode_id")
            if scope is not None and key not in scope:
                raise CheckpointError(f"{self.instance} exported {key!r}, which is outside the commit scope")
            keys.append(key)
        return keys

    async def _restore(self, req: RestoreRequest) -> dict[str, Any]:
        cid = req.checkpoint_id
        wanted = _keys(req.episode_ids) or ()
        args = (req.checkpoint_dir, wanted, req.source_checkpoint_id)
        async with self._lock:
            self._check_stale(cid)
            stored = self._stored(cid, "restore", args)
            if stored is not None:
                return stored
            self._admit(cid, "restore", {"idle"})
            _, records = await asyncio.to_thread(
                read_participant_state,
                req.checkpoint_dir,
                self.participant.kind,
                self.instance,
                req.source_checkpoint_id,
            )
            selected = self._select(records, set(wanted), req)
            restored = await self.participant.install(selected)
            self._phase, self._checkpoint_id = "restored", cid
            self._extend_lease(req.deadline_ts)
            reply = dump(RestoreReply(phase="restored", source_checkpoint_id=req.source_checkpoint_id,
                                      restored=list(restored)))
            self._store(cid, "restore", args, reply)
            return reply

    def _select(self, records: list[Record], wanted: set[str], req: RestoreRequest) -> list[Record]:
        where = f"checkpoint {req.source_checkpoint_id!r} of {self.instance} in {req.checkpoint_dir}"
        selected: list[Record] = []
        found: set[str] = set()
        for index, record in enumerate(records):
            try:
                key = EpisodeId.model_validate(record["episode_id"]).capture_key
            except (KeyError, TypeError, ValidationError):
                raise CheckpointError(f"record {index} of {where} has no valid episode_id") from None
            if key in wanted:
                selected.append(record)
                found.add(key)
        missing = sorted(wanted - found)
        if missing:
            raise CheckpointError(f"{where} has no records for {missing[:10]} ({len(missing)} missing)")
        return selected

    async def _resume(self, req: ResumeRequest) -> dict[str, Any]:
        cid = req.checkpoint_id
        async with self._lock:
            if cid in self._resumed:
                return dump(ResumeReply(phase="idle", idempotent=True))
            if self._phase == "idle" and not self._closed:
                self._fence(cid)  # never prepared: nothing to reopen, but the id is now spent
                return dump(ResumeReply(phase="idle", idempotent=True))
            if self._checkpoint_id is not None and self._checkpoint_id != cid:
                raise CheckpointError(
                    f"resume for {cid!r} refused: checkpoint {self._checkpoint_id!r} is active",
                    code="checkpoint_conflict",
                )
            await self._reopen()
            self._fence(cid)
            return dump(ResumeReply(phase="idle", idempotent=False))

    # -- lease ---------------------------------------------------------------
    async def _watch_lease(self) -> None:
        while True:
            self._lease_changed.clear()
            expires = self._lease_expires_at
            if expires is None:
                await self._lease_changed.wait()
                continue
            delay = expires - self._clock()
            if delay > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._lease_changed.wait(), timeout=min(delay, 1.0))
                continue
            try:
                await self._expire()
            except Exception:
                logger.exception("checkpoint control %s: reopening after lease expiry failed", self.instance)
                await asyncio.sleep(1.0)

    async def _expire(self) -> None:
        async with self._lock:
            expires = self._lease_expires_at
            if expires is None or expires > self._clock():
                return  # renewed or resumed meanwhile
            cid = self._checkpoint_id
            logger.warning("checkpoint control %s: lease of %r expired in phase %s; reopening",
                           self.instance, cid, self._phase)
            await self._reopen()
            if cid is not None:
                self._fence(cid)
