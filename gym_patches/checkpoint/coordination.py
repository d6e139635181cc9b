"""Client side of the checkpoint protocol: one Gym deployment, many participants (docs/design.md §4.6).

``call(participants, request)`` runs one typed request (``gym_patches.checkpoint.calls``) over
every participant; each request says which body each server gets. ``PrepareCall`` walks
``PREPARE_ORDER`` so callees close before their callers park, and stops at the first stage
that is not ready (its blockers are the answer). Commit, persist and restore fan out at once;
``ResumeCall`` reopens every server at once and keeps going past failures, so one dead server
cannot leave the others closed.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable, Iterator, Mapping, Sequence, TypeVar

import aiohttp
from pydantic import ValidationError

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
from gym_patches.checkpoint.identity import EpisodeId, next_attempt
from gym_patches.checkpoint.wire import (
    CHECKPOINT_ROUTE_PREFIX,
    PREPARE_ORDER,
    CheckpointRequest,
    ParticipantKind,
    PrepareReply,
    RestoreReply,
    ResumeReply,
    RetireReply,
    StatusReply,
    dump,
)

logger = logging.getLogger(__name__)

SERVER_TYPE_KIND: dict[str, ParticipantKind] = {
    "responses_api_models": "model",
    "responses_api_agents": "agent",
    "resources_servers": "resources",
}
# Callers before callees: a retired run stops before the calls it would make.
RETIRE_ORDER: tuple[tuple[ParticipantKind, ...], ...] = (("agent",), ("model", "resources"))
CALL_TIMEOUT_SLACK_S = 5.0
# Undoing a failed restore gets a fresh deadline: servers refuse a deadline already past.
UNDO_DEADLINE_S = 30.0

_T = TypeVar("_T")


class CoordinationError(RuntimeError):
    """A control call to one Gym server failed; names the server."""

    def __init__(self, server: str, status: int | None, code: str | None, detail: str, *, message: str | None = None):
        where = f"HTTP {status}" if status is not None else "no reply"
        super().__init__(message or f"Gym server {server!r}: {code or 'error'} ({where}): {detail}")
        self.server, self.status, self.code, self.detail = server, status, code, detail
        self._message = message

    def __reduce__(self):  # crosses process boundaries (e.g. Ray) with its fields
        return (_rebuild_coordination_error, (self.server, self.status, self.code, self.detail, self._message))


def _rebuild_coordination_error(server, status, code, detail, message):
    return CoordinationError(server, status, code, detail, message=message)


class CoordinationFailures(CoordinationError):
    """Several servers failed one fan-out; ``failures`` maps server -> error."""

    def __init__(self, op: str, failures: Mapping[str, BaseException]):
        self.failures = dict(failures)
        names = sorted(self.failures)
        detail = "; ".join(str(self.failures[name]) for name in names)
        super().__init__(", ".join(names), None, f"{op}_failed", detail,
                         message=f"{op} failed on {len(names)} Gym servers ({', '.join(names)}): {detail}")
        self.op = op

    def __reduce__(self):
        return (CoordinationFailures, (self.op, self.failures))


class ControlClient:
    """Authenticated calls to the control routes; the timeout follows the deadline."""

    def __init__(self, session: aiohttp.ClientSession, auth_token: str, *, clock: Callable[[], float] = time.time):
        if not auth_token:
            raise ValueError("ControlClient needs a non-empty auth_token")
        self.session = session
        self._headers = {"Authorization": f"Bearer {auth_token}"}
        self._clock = clock

    def now(self) -> float:
        return self._clock()

    def timeout_for(self, deadline_ts: float) -> float:
        return max(0.0, deadline_ts - self._clock()) + CALL_TIMEOUT_SLACK_S

    async def get(self, server: str, url: str, route: str, *, timeout_s: float) -> dict[str, Any]:
        return await self._call("GET", server, url, route, None, timeout_s)

    async def post(
        self, server: str, url: str, route: str, request: CheckpointRequest, *, timeout_s: float | None = None
    ) -> dict[str, Any]:
        """``timeout_s`` caps the wait below the deadline's (a resume must not wait on a hung server)."""
        limit = self.timeout_for(request.deadline_ts)
        return await self._call("POST", server, url, route, dump(request),
                                limit if timeout_s is None else min(limit, timeout_s))

    async def _call(
        self, method: str, server: str, url: str, route: str, body: Any, timeout_s: float
    ) -> dict[str, Any]:
        target = f"{url.rstrip('/')}{CHECKPOINT_ROUTE_PREFIX}/{route}"
        try:
            async with self.session.request(
                method, target, json=body, headers=self._headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                text = await resp.text()
                status = resp.status
        except asyncio.TimeoutError:
            raise CoordinationError(server, None, "timeout", f"{method} {route} took over {timeout_s:.1f}s") from None
        except aiohttp.ClientError as exc:
            raise CoordinationError(server, None, "unreachable", f"{method} {route} at {url}: {exc!r}") from None
        try:
            payload: Any = json.loads(text) if text else None
        except ValueError:
            payload = None
        if not 200 <= status < 300:
            error = payload.get("error") if isinstance(payload, dict) else None
            if isinstance(error, dict):
                raise CoordinationError(server, status, str(error.get("code")), str(error.get("detail")))
            raise CoordinationError(server, status, None, f"{method} {route}: {text[:500]}")
        if not isinstance(payload, dict):
            raise CoordinationError(server, status, "bad_reply", f"{method} {route} did not return a JSON object")
        return payload


@dataclass(frozen=True)
class Participant:
    name: str
    kind: ParticipantKind
    url: str
    status: StatusReply


class Participants:
    """The checkpointing servers of one deployment, in prepare order, plus their client."""

    def __init__(self, members: Sequence[Participant], control: ControlClient):
        names = [m.name for m in members]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate participant names: {sorted(n for n in set(names) if names.count(n) > 1)}")
        self.members: tuple[Participant, ...] = tuple(members)
        self.control = control

    def by_kind(self, kind: str) -> list[Participant]:
        return [m for m in self.members if m.kind == kind]

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.members]

    def __iter__(self) -> Iterator[Participant]:
        return iter(self.members)

    def __len__(self) -> int:
        return len(self.members)


def _order(p: Participant) -> tuple[int, str]:
    return PREPARE_ORDER.index(p.kind), p.name


async def discover(client: Any, auth_token: str, *, timeout_s: float = 30.0) -> Participants:
    """Ask every model/agent/resources server for its status; 404 = not a participant."""
    control = ControlClient(client.session, auth_token)
    instances = client.instances()
    if inspect.isawaitable(instances):
        instances = await instances
    candidates = [i for i in instances if i.server_type in SERVER_TYPE_KIND]

    async def probe(inst: Any) -> Participant | None:
        try:
            body = await control.get(inst.name, inst.url, "status", timeout_s=timeout_s)
        except CoordinationError as exc:
            if exc.status == 404:
                return None
            raise
        try:
            status = StatusReply.model_validate(body)
        except ValidationError as exc:
            raise CoordinationError(inst.name, 200, "bad_reply", f"malformed status: {_fields(exc)}") from None
        expected = SERVER_TYPE_KIND[inst.server_type]
        if status.kind != expected:
            raise CoordinationError(
                inst.name, 200, "kind_mismatch",
                f"status says kind {status.kind!r}, but it is configured as {inst.server_type} ({expected!r})",
            )
        return Participant(name=inst.name, kind=expected, url=inst.url, status=status)

    found = await _gather_all("discover", {i.name: probe(i) for i in candidates})
    members = sorted((p for p in found.values() if p is not None), key=_order)
    if not any(p.kind == "model" for p in members):
        raise CoordinationError(
            "<deployment>", None, "no_model",
            f"no model server takes part in checkpoints (servers checked: {sorted(found)})",
        )
    return Participants(members, control)


@dataclass
class PrepareResult:
    prepared: bool
    blockers: dict[str, list[str]] = field(default_factory=dict)
    unsaved: dict[str, list[str]] = field(default_factory=dict)
    replies: dict[str, PrepareReply] = field(default_factory=dict)
    kinds: dict[str, ParticipantKind] = field(default_factory=dict)  # server -> kind, of every reply

    def captured_keys(self, kind: ParticipantKind) -> set[str]:
        """What the servers of ``kind`` captured (a ``capture`` prepare); agents' = turn-level saves."""
        # set.union over the replies' lists: C-level, as this runs while every rollout is held
        return set().union(*(reply.captured or () for name, reply in self.replies.items()
                              if self.kinds.get(name) == kind))

    def captured_bytes(self) -> dict[str, int]:
        """Server -> size of the in-memory copy it holds until ``persist``."""
        return {name: reply.captured_bytes for name, reply in self.replies.items() if reply.captured_bytes}

    def unsaved_keys(self) -> set[str]:
        """Capture keys some participant cannot save: they restart after a crash."""
        return {key for keys in self.unsaved.values() for key in keys}

    def ended_keys(self) -> set[str] | None:
        """Capture keys of /runs the agents answered lately (replies maybe still on the wire); None when
        an agent did not say, so a caller must assume any rollout it lacks may have ended."""
        agents = [reply for name, reply in self.replies.items() if self.kinds.get(name) == "agent"]
        if any(reply.report.ended is None for reply in agents):
            return None
        return {key for reply in agents for key in reply.report.ended or ()}

    def continued(self, episode_ids: Iterable[EpisodeId]) -> list[EpisodeId]:
        """The scope minus unsaved rollouts: what a commit can keep at turn level."""
        unsaved = self.unsaved_keys()
        return [e for e in episode_ids if e.capture_key not in unsaved]


async def call(participants: Participants, request: GymCall) -> Any:
    """Run one checkpoint verb over the participants: the one entry, whatever the verb.

    Prepare returns a ``PrepareResult``, probe server -> ``StatusReply`` or the error, every other
    verb server -> its reply. A server error raises (``CoordinationError``, several together as
    ``CoordinationFailures``); after any prepare, also a failed one, the caller must resume this id.
    """
    runner = _RUNNERS.get(type(request))
    if runner is None:
        raise TypeError(f"not a checkpoint call: {type(request).__name__} (expected one of "
                        f"{sorted(c.__name__ for c in _RUNNERS)})")
    unknown = sorted(request.servers_named() - set(participants.names))
    if unknown:
        raise ValueError(f"{request.route} {request.per_server_field} names servers that are not participants: "
                         f"{unknown}")
    return await runner(participants, request)


async def _prepare(participants: Participants, request: PrepareCall) -> PrepareResult:
    """Stage by stage in ``PREPARE_ORDER``; stop at the first stage with an unprepared reply.

    With ``capture`` each server serialises its sessions in memory as it becomes prepared (a
    staged snapshot: no commit; persist writes each server's scope after resume)."""
    result = PrepareResult(prepared=True)
    for kind in PREPARE_ORDER:
        stage = participants.by_kind(kind)
        if not stage:
            continue
        replies = await _fan_out(participants, stage, request)
        for name, reply in replies.items():
            result.replies[name] = reply
            result.kinds[name] = kind
            if reply.report.unsaved:
                result.unsaved[name] = list(reply.report.unsaved)
            if reply.phase != "prepared":
                result.blockers[name] = list(reply.report.blockers)
        if any(r.phase != "prepared" for r in replies.values()):
            result.prepared = False
            break
    return result


async def _at_once(participants: Participants, request: GymCall) -> dict[str, Any]:
    """Renew, forget, commit, persist: every server at once."""
    return await _fan_out(participants, participants.members, request)


async def _restore(participants: Participants, request: RestoreCall) -> dict[str, RestoreReply]:
    """Install everywhere at once; on failure retire the next attempts it may have installed on
    every server (best effort), resume all with a fresh deadline, and re-raise."""
    try:
        return await _fan_out(participants, participants.members, request)
    except Exception as exc:
        logger.warning("restore of %s failed (%s); retiring its next attempts and resuming",
                       request.checkpoint_id, exc)
        everything = {e.capture_key: e for name in participants.names for e in request.scope_for(name) or []}
        undo_deadline = max(request.deadline_ts, participants.control.now() + UNDO_DEADLINE_S)
        if everything:
            with _suppress_logged("retire after failed restore"):
                await _retire(participants, RetireCall(
                    checkpoint_id=request.checkpoint_id, deadline_ts=undo_deadline,
                    episode_ids=[next_attempt(e) for e in everything.values()], best_effort=True))
        with _suppress_logged("resume after failed restore"):
            await _resume(participants, ResumeCall(checkpoint_id=request.checkpoint_id, deadline_ts=undo_deadline))
        raise


async def _resume(participants: Participants, request: ResumeCall) -> dict[str, ResumeReply]:
    """Every server at once (each within ``call_timeout_s``), failures raised together.

    No order is needed: every server holds what reaches it while closed (a model call, a tool call,
    a reply that reaches a prepared agent), and what a checkpoint saved was fixed before resume.
    At once, the pause ends one round trip after the slowest server answers instead of three
    stages' worth of round trips to busy event loops (docs/design.md §4.6)."""
    members = participants.members
    outcomes = await asyncio.gather(
        *(_post(participants, p, request, timeout_s=request.call_timeout_s) for p in members),
        return_exceptions=True,
    )
    replies: dict[str, ResumeReply] = {}
    failures: dict[str, BaseException] = {}
    for p, outcome in zip(members, outcomes):
        if isinstance(outcome, asyncio.CancelledError):
            raise outcome
        if isinstance(outcome, BaseException):
            failures[p.name] = outcome
        else:
            replies[p.name] = outcome
    if failures:
        raise CoordinationFailures("resume", failures)
    return replies


async def _probe(participants: Participants, request: ProbeCall) -> dict[str, StatusReply | CoordinationError]:
    """Every server's status, or why it gave none within ``timeout_s``: only a server that does not
    answer at all (stopped, deadlocked) is to blame for a stalled prepare, not a slow one."""

    async def one(p: Participant) -> StatusReply | CoordinationError:
        try:
            body = await participants.control.get(p.name, p.url, request.route, timeout_s=request.timeout_s)
            return StatusReply.model_validate(body)
        except CoordinationError as exc:
            return exc
        except ValidationError as exc:
            return CoordinationError(p.name, 200, "bad_reply", f"malformed status: {_fields(exc)}")

    outcomes = await asyncio.gather(*(one(p) for p in participants))
    return {p.name: outcome for p, outcome in zip(participants, outcomes)}


async def _retire(participants: Participants, request: RetireCall) -> dict[str, RetireReply]:
    """Agents first, then models and resources (``RETIRE_ORDER``)."""
    replies: dict[str, RetireReply] = {}
    failures: dict[str, BaseException] = {}
    for kinds in RETIRE_ORDER:
        stage = [p for p in participants if p.kind in kinds]
        if not stage:
            continue
        try:
            replies.update(await _fan_out(participants, stage, request))
        except CoordinationFailures as exc:
            if not request.best_effort:
                raise
            failures.update(exc.failures)
        except CoordinationError as exc:
            if not request.best_effort:
                raise
            failures[exc.server] = exc
    if failures:
        raise CoordinationFailures("retire", failures)
    return replies


_RUNNERS: dict[type, Callable[[Participants, Any], Awaitable[Any]]] = {
    PrepareCall: _prepare,
    RenewCall: _at_once,
    ForgetCall: _at_once,
    CommitCall: _at_once,
    PersistCall: _at_once,
    RestoreCall: _restore,
    ResumeCall: _resume,
    ProbeCall: _probe,
    RetireCall: _retire,
}


# -- helpers -----------------------------------------------------------------
async def _fan_out(participants: Participants, stage: Sequence[Participant], request: GymCall) -> dict[str, Any]:
    """Post each server of ``stage`` its body of ``request``, all at once."""
    return await _gather_all(request.route, {p.name: _post(participants, p, request) for p in stage})


async def _post(participants: Participants, p: Participant, request: GymCall, *,
                timeout_s: float | None = None) -> Any:
    """``p``'s body of ``request``, posted; the reply checked against the call's reply model."""
    body = await participants.control.post(p.name, p.url, request.route, request.body_for(p.name),
                                           timeout_s=timeout_s)
    try:
        return request.reply.model_validate(body)
    except ValidationError as exc:
        raise CoordinationError(p.name, 200, "bad_reply",
                                f"malformed {request.reply.__name__}: {_fields(exc)}") from None


async def _gather_all(op: str, calls: Mapping[str, Awaitable[_T]]) -> dict[str, _T]:
    """Run all calls to completion; one failure is raised as is, several together."""
    names = list(calls)
    outcomes = await asyncio.gather(*calls.values(), return_exceptions=True)
    failures: dict[str, BaseException] = {}
    results: dict[str, _T] = {}
    for name, outcome in zip(names, outcomes):
        if isinstance(outcome, asyncio.CancelledError):
            raise outcome
        if isinstance(outcome, BaseException):
            failures[name] = outcome
        else:
            results[name] = outcome
    if len(failures) == 1:
        raise next(iter(failures.values()))
    if failures:
        raise CoordinationFailures(op, failures)
    return results


def _fields(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in exc.errors())


class _suppress_logged:
    """Swallow and log an exception from a best-effort cleanup step."""

    def __init__(self, what: str):
        self.what = what

    def __enter__(self) -> "_suppress_logged":
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is not None and isinstance(exc, Exception):
            logger.warning("%s failed: %s", self.what, exc)
            return True
        return False
