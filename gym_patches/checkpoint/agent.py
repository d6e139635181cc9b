"""Checkpoint participants of Gym agents (docs/design.md §4.5).

``AgentSessionParticipant`` parks each running ``/run`` of the session agent at
a loop boundary and exports its loop state. ``RestartOnlyAgentParticipant``
serves agents that cannot do that: it only tracks running ``/run`` calls, which
either block a checkpoint (policy ``block``) or are reported unsaved
(``best_effort``), so a restart-only agent never stalls a best-effort snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Collection, Literal, TypeVar, get_args

from aiohttp import web
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from gym_patches.checkpoint.errors import AdmissionClosedError, CheckpointError, StaleAttemptError
from gym_patches.checkpoint.identity import EpisodeId, next_attempt
from gym_patches.checkpoint.participant import CheckpointParticipant, Record
from gym_patches.checkpoint.records import CapturedRecord, Fragment, capture_record, fragment, plain
from gym_patches.checkpoint.wire import ENDED_WINDOW_S, PrepareReport, RestartOnlyPolicy
from gym_patches.responses_api_agents.admission import StartGate
from gym_patches.responses_api_agents.loop import RunRequestError, SimpleAgentLoopState, parse_run_body
from gym_patches.server_utils import cancel_and_wait, json_error
from gym_patches.utils.pacing import TurnPacer, claim_pacing
from gym_patches.wire_models import Boundary

T = TypeVar("T")

SessionPhase = Literal["admitting", "seeding", "running", "awaiting_model", "holding_reply", "parked"]
_WAITING_ON_MODEL: frozenset[str] = frozenset({"awaiting_model", "holding_reply"})
_MUTABLE: frozenset[str] = frozenset({"seeding", "running"})  # the only phases in which the loop changes its state
_NOT_STARTED: frozenset[str] = frozenset({"admitting", "seeding"})  # before the first boundary: nothing to save
_AT_BOUNDARY: frozenset[str] = frozenset({"parked", *_WAITING_ON_MODEL})  # a commit exports these


def declared_replayable(agent: Any) -> bool:
    """The agent's ``replayable`` (its config): given the model's replies, its loop makes the same calls,
    so its rollouts can come back by replay (only its status says so; RL decides)."""
    return getattr(getattr(agent, "config", None), "replayable", False) is True


def session_key(episode: EpisodeId) -> str:
    """Stable across attempts, so a record names the rollout's session, not the try."""
    return f"run:{episode.rollout_id}"


class AgentSessionRecord(BaseModel):
    """One parked session as committed to the store and installed on restore."""

    model_config = ConfigDict(extra="forbid")

    episode_id: EpisodeId
    session_key: str
    boundary: Boundary
    state: SimpleAgentLoopState

    @model_validator(mode="after")
    def _consistent(self) -> "AgentSessionRecord":
        if self.session_key != session_key(self.episode_id):
            raise ValueError(f"session_key {self.session_key!r} does not match episode {self.episode_id}")
        if (self.boundary == "P1") != self.state.pending_tools:
            raise ValueError(f"boundary {self.boundary} does not fit state.pending_tools={self.state.pending_tools}")
        if self.boundary == "P1" and not self.state.pending_calls():
            raise ValueError("boundary P1 needs state.last_model_response with function calls")
        if self.boundary != "B0" and self.state.step < 1:
            raise ValueError(f"boundary {self.boundary} needs state.step >= 1")
        if not isinstance(self.state.seed_row.get("responses_create_params"), dict):
            raise ValueError("state.seed_row has no responses_create_params")
        return self


def make_record(episode: EpisodeId, boundary: Boundary, state: SimpleAgentLoopState | Fragment) -> Record:
    """The session's record; its loop state goes in as a JSON fragment (the bulk of a capture)."""
    return {
        "episode_id": {"rollout_id": episode.rollout_id, "attempt": episode.attempt},
        "session_key": session_key(episode),
        "boundary": boundary,
        "state": state if isinstance(state, Fragment) else fragment(state),
    }


@dataclass(eq=False)
class _Session:
    """One running ``/run``. ``state`` is the loop's live state object; the loop
    only mutates it while ``phase`` is seeding/running, so in every parked phase
    it equals the state at ``boundary``. Hashed by identity (the participant's phase sets)."""

    episode: EpisodeId
    phase: SessionPhase = "admitting"
    key: str = field(init=False)  # the capture key, made once
    listed: bool = False  # in the participant's table (and its phase sets)
    boundary: Boundary | None = None
    state: SimpleAgentLoopState | None = None
    task: "asyncio.Task[Any] | None" = None
    retired: bool = False
    # Times the session entered a phase in which the loop may change its state: versions the state,
    # so a capture of a session that has not moved since the previous snapshot reuses that one's bytes.
    version: int = 0
    captured: "tuple[int, CapturedRecord] | None" = None

    def __post_init__(self) -> None:
        self.key = self.episode.capture_key


@dataclass(frozen=True)
class RestoredSession:
    """An installed record waiting for the ``/run`` of its new attempt."""

    episode: EpisodeId  # the new attempt
    boundary: Boundary
    state: SimpleAgentLoopState


class Activation:
    """The loop's handle on its session: boundaries, the model wait, the seed."""

    def __init__(self, participant: "AgentSessionParticipant", session: _Session):
        self._p = participant
        self._s = session

    @property
    def capture_key(self) -> str:
        return self._s.episode.capture_key

    async def boundary(self, name: Boundary, state: SimpleAgentLoopState) -> None:
        """Record the boundary; park here (wait for reopen) while admission is closed."""
        s = self._s
        s.boundary, s.state = name, state
        if not self._p.accepting:
            self._p._set_phase(s, "parked")
            await self._p._until_reopened(s)
        self._p._set_phase(s, "running")

    @contextlib.asynccontextmanager
    async def awaiting_model(self) -> AsyncIterator[None]:
        """The model call. While it runs the session counts as parked at its last
        boundary (B0). A reply that arrives after the agent has reported itself
        ready is kept but not acted on until reopen, so the place it was counted
        at stays true; before that, the session goes on and parks at P1."""
        s = self._s
        self._p._set_phase(s, "awaiting_model")
        try:
            yield
        except BaseException:
            self._p._set_phase(s, "running")
            raise
        if self._p._ready_reported:  # only ever set while closed
            self._p._set_phase(s, "holding_reply")
            await self._p._until_reopened(s)
        self._p._set_phase(s, "running")

    @contextlib.asynccontextmanager
    async def seeding(self) -> AsyncIterator[None]:
        """Seeds wait for a start slot (``StartGate``: still ``admitting``, nothing to save) and,
        while closed, for reopen. A seed in flight does not block readiness: until its first boundary
        a run is not started (reported unsaved; it restarts from its prompt, losing only the seed),
        and a seed that ends while closed waits for reopen before the run's first turn, so a
        prepare never waits on seeds (docs/design.md §4.5)."""
        p, s = self._p, self._s
        async with p.start_gate.slot():
            await p._until_reopened(s)
            p._set_phase(s, "seeding")
            try:
                yield
            except BaseException:
                p._set_phase(s, "running")
                raise
            await p._until_reopened(s)
            p._set_phase(s, "running")


Runner = Callable[..., Awaitable[T]]


class EndedRuns:
    """Capture keys of the ``/run`` calls an agent answered in the last ``ENDED_WINDOW_S``, oldest
    first: a prepare reports them (``PrepareReport.ended``) so the caller waits only for replies that
    may still be on the wire, and not for calls that never reached the agent (docs/design.md §5.4)."""

    def __init__(self, window_s: float = ENDED_WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self.clock = clock
        self._at: dict[str, float] = {}  # insertion order is end order

    def add(self, key: str) -> None:
        self._at.pop(key, None)
        self._at[key] = self.clock()
        self._forget_old()

    def keys(self) -> list[str]:
        self._forget_old()
        return list(self._at)

    def _forget_old(self) -> None:
        oldest = self.clock() - self.window_s
        while self._at:
            key = next(iter(self._at))
            if self._at[key] >= oldest:
                break
            del self._at[key]


class AgentSessionParticipant(CheckpointParticipant):
    """Participant of ``simple_agent``: one session per running ``/run``, parked at a boundary."""

    kind = "agent"

    def __init__(self, agent: Any = None):
        super().__init__()
        self.name: str = getattr(agent, "name", None) or "agent"
        self.replayable = declared_replayable(agent)
        # The agent's bound on runs starting at once (one per server, shared with its loop).
        gate = getattr(agent, "start_gate", None)
        self.start_gate: StartGate = gate if isinstance(gate, StartGate) else StartGate()
        # The server's pacer (``GymServer.pacer``): while closed, a running session's steps go first.
        pacer = getattr(agent, "pacer", None)
        self.pacer: TurnPacer | None = pacer if isinstance(pacer, TurnPacer) else None
        self._sessions: dict[str, _Session] = {}
        self._restored: dict[str, RestoredSession] = {}
        self._reopened = asyncio.Event()
        self._reopened.set()
        self._ready_reported = False  # this close cycle told someone "ready"
        # The listed sessions by phase, kept on every move, so readiness and a capture look only at
        # the few that block or changed instead of scanning every session while rollouts are held.
        self._by_phase: dict[str, set[_Session]] = {phase: set() for phase in get_args(SessionPhase)}
        # Every listed session at a boundary is in exactly one of these: its record made since it came
        # to rest (what a capture hands over as it is), or not made yet (it came to rest before the
        # first checkpoint, or serialising failed: what ``close_admission`` and a capture still make).
        self._records: dict[_Session, CapturedRecord] = {}
        self._uncaptured: set[_Session] = set()
        self._ended = EndedRuns()

    def status_extra(self) -> dict[str, Any]:
        return {"restart_only": False, "replayable": self.replayable}

    # -- running sessions --------------------------------------------------
    def is_restored(self, capture_key: str) -> bool:
        return capture_key in self._restored

    async def run_session(self, episode: EpisodeId, runner: Runner[T]) -> T:
        """Host one ``/run``: ``runner(activation)`` for a fresh episode, or
        ``runner(activation, boundary, state)`` to continue a restored one."""
        self.check_attempt(episode)
        key = episode.capture_key
        if key in self._sessions:
            raise RunRequestError(409, "rollout_in_progress", f"{self.name}: a /run for {key} is already running")
        s = _Session(episode)
        self._list(s)
        s.task = asyncio.create_task(self._drive(s, runner), name=f"agent-run:{key}")
        self.notify_changed()
        try:
            return await s.task
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if s.retired and not (me is not None and me.cancelling()):
                raise StaleAttemptError(f"{key} was retired while running on {self.name}") from None
            raise
        finally:
            if self._sessions.get(key) is s:
                self._unlist(s)
                self._ended.add(key)  # its reply (or error) is on its way to the caller now
            self.notify_changed()

    def _list(self, s: _Session) -> None:
        self._sessions[s.key] = s
        s.listed = True
        self._by_phase[s.phase].add(s)

    def _unlist(self, s: _Session) -> None:
        del self._sessions[s.key]
        s.listed = False
        self._by_phase[s.phase].discard(s)
        self._records.pop(s, None)
        self._uncaptured.discard(s)

    async def _drive(self, s: _Session, runner: Runner[T]) -> T:
        # This task's paced steps (its tool calls, their replies, its verify) hold up a prepare
        # while it runs between boundaries with admission closed: they go before the burst's seeds.
        claim_pacing(lambda: not self.accepting and s.phase == "running")
        await self._until_reopened(s)  # a /run that arrives while closed waits
        restored = self._restored.pop(s.episode.capture_key, None)
        act = Activation(self, s)
        if restored is None:
            return await runner(act)
        s.boundary, s.state = restored.boundary, restored.state
        self._set_phase(s, "running")
        return await runner(act, restored.boundary, restored.state)

    def _set_phase(self, s: _Session, phase: SessionPhase) -> None:
        old = s.phase
        if old != phase:
            if phase in _MUTABLE:
                s.version += 1
            s.phase = phase
            if s.listed:
                self._by_phase[old].discard(s)
                self._by_phase[phase].add(s)
                if phase in _MUTABLE:
                    self._records.pop(s, None)
                    self._uncaptured.discard(s)
                elif phase in _AT_BOUNDARY:
                    if s not in self._records:
                        self._uncaptured.add(s)
                    if self.capture_eagerly or not self.accepting:
                        self._precapture(s)
            self.notify_changed()

    def _captured(self, s: _Session) -> CapturedRecord:
        """The parked session's record, checked and frozen, made again only if the session may have
        moved: the loop changes its state and boundary only in a mutable phase, and every entry
        into one bumps ``version``."""
        assert s.state is not None and s.boundary is not None
        if s.captured is None or s.captured[0] != s.version:
            entry = capture_record(make_record(s.episode, s.boundary, fragment(s.state)))
            if entry is None:  # cannot happen: an EpisodeId, strings and a fragment
                raise CheckpointError(f"{self.name}: the record of session {s.episode} cannot be captured")
            s.captured = (s.version, entry)
            if s.listed and s.phase in _AT_BOUNDARY:
                self._records[s] = entry
                self._uncaptured.discard(s)
        return s.captured[1]

    def _precapture(self, s: _Session) -> None:
        """Serialise a session as it comes to rest (while a checkpoint is being prepared, and, once
        one has been, while open too: ``capture_eagerly``), so the capture finds the work done
        instead of doing it while every rollout is held. Failures are left for the capture to report."""
        if s.state is not None and s.boundary is not None:
            try:
                self._captured(s)
            except Exception:
                s.captured = None

    async def _until_reopened(self, s: _Session) -> None:
        # A park is requested of every session exactly while admission is closed.
        while not self.accepting:
            await self._reopened.wait()

    # -- admission ---------------------------------------------------------
    async def close_admission(self, policy: RestartOnlyPolicy) -> None:
        self.policy = policy
        self.accepting = False
        self.capture_eagerly = True
        self._ready_reported = False
        if self._reopened.is_set():
            self._reopened = asyncio.Event()
        for s in list(self._uncaptured):  # every other session at rest was serialised as it came to rest
            self._precapture(s)
        if self.pacer is not None:
            self.pacer.promote()  # the running sessions' steps already in line go first from now
        self.notify_changed()

    async def open_admission(self) -> None:
        self.accepting = True
        self._ready_reported = False
        self._reopened.set()
        self.notify_changed()

    def readiness(self) -> PrepareReport:
        by_phase = self._by_phase
        blockers = [s.key for s in by_phase["running"]]
        # An admitting /run has done nothing yet (it arrived while closed, or waits for a start slot),
        # and a seeding one only its seed: nothing to save before the first boundary, so after a crash
        # it restarts from its prompt. Saying so keeps it out of commit scopes.
        admitting = by_phase["admitting"]
        unsaved = [s.key for s in admitting if s.key not in self._restored] + [s.key for s in by_phase["seeding"]]
        pending = len(self._restored)  # installed, /run not started yet (a waiting one is skipped above)
        counts = {"sessions": len(self._sessions) - len(admitting) + pending,
                  "at_boundary": len(by_phase["parked"]) + pending,
                  "awaiting_model": len(by_phase["awaiting_model"]) + len(by_phase["holding_reply"])}
        report = PrepareReport.build(blockers, unsaved, counts)
        if report.ready and not self.accepting:
            self._ready_reported = True
        return report

    def is_ready(self) -> bool:
        return not self._by_phase["running"]

    def ended_runs(self) -> list[str]:
        return self._ended.keys()

    # -- lifecycle ---------------------------------------------------------
    def _exportable(self, wanted: set[str] | None) -> list[_Session]:
        """The sessions a commit of ``wanted`` (None: all) exports, in key order; raises for one in
        scope that is not at a boundary."""
        out: list[_Session] = []
        keys = self._sessions if wanted is None else [k for k in wanted if k in self._sessions]
        for key in sorted(keys):
            s = self._sessions[key]
            if s.phase in _NOT_STARTED:
                if key in self._restored or wanted is None:
                    continue  # a restored one is exported from ``_restored``
                raise CheckpointError(
                    f"{self.name}: /run {key} has not reached its first boundary ({s.phase}); "
                    "it has nothing to save"
                )
            if s.phase != "parked" and s.phase not in _WAITING_ON_MODEL:
                raise CheckpointError(f"{self.name}: session {key} is {s.phase}, not parked at a boundary")
            if s.state is None or s.boundary is None:
                raise CheckpointError(f"{self.name}: session {key} has no boundary state")
            out.append(s)
        return out

    def _restored_records(self, wanted: set[str] | None, ordered: bool = True) -> list[Record]:
        restored = sorted(self._restored.items()) if ordered else self._restored.items()
        return [make_record(r.episode, r.boundary, r.state)
                for key, r in restored if wanted is None or key in wanted]

    async def export(self, episodes: list[EpisodeId] | None) -> list[Record]:
        wanted = None if episodes is None else {e.capture_key for e in episodes}
        records: list[Record] = [make_record(s.episode, s.boundary, self._captured(s).record["state"])
                                 for s in self._exportable(wanted)]
        return records + self._restored_records(wanted)

    async def capture_records(self) -> list[Any]:
        """Each parked session's ``CapturedRecord``, kept while it has not moved (most were made as
        the sessions came to rest, so this does almost no work while rollouts are held). In no
        particular order: the capture keys them by capture key."""
        if self._by_phase["running"]:
            self._exportable(None)  # raises, naming the first session (in key order) not at a boundary
        out: list[Any] = list(self._records.values())
        for s in list(self._uncaptured):
            if s.state is None or s.boundary is None:
                self._exportable(None)  # raises for the first such session in key order
            out.append(self._captured(s))
        return out + self._restored_records(None, ordered=False)

    async def install(self, records: list[Record], replay: Collection[str] = ()) -> list[str]:
        self.refuse_replay(replay, self.name)
        parsed: list[RestoredSession] = []
        seen: set[str] = set()
        for index, raw in enumerate(records):
            try:
                rec = AgentSessionRecord.model_validate(plain(raw) if isinstance(raw, dict) else raw)
            except ValidationError as exc:
                where = raw.get("episode_id") if isinstance(raw, dict) else None
                detail = "; ".join(
                    f"{'.'.join(str(p) for p in e['loc']) or '<record>'}: {e['msg']}" for e in exc.errors()
                )
                raise CheckpointError(f"{self.name}: agent record {index} (episode {where}) is invalid: {detail}") from None
            new = next_attempt(rec.episode_id)
            key = new.capture_key
            if key in seen:
                raise CheckpointError(f"{self.name}: two records for episode {rec.episode_id}")
            seen.add(key)
            try:
                self.check_attempt(new)
            except StaleAttemptError as exc:
                raise CheckpointError(f"{self.name}: cannot restore into {key}: {exc.detail}") from None
            if key in self._sessions:
                raise CheckpointError(f"{self.name}: cannot restore {key}: a /run for it is already running")
            parsed.append(RestoredSession(new, rec.boundary, rec.state))
        for r in parsed:
            self._restored[r.episode.capture_key] = r
        self.notify_changed()
        return [r.episode.capture_key for r in parsed]

    async def retire(self, episodes: list[EpisodeId]) -> list[str]:
        tasks: list[asyncio.Task[Any]] = []
        for e in episodes:
            self.mark_retired(e)
            for key, r in list(self._restored.items()):
                if _covers(e, r.episode):
                    del self._restored[key]
            for s in self._sessions.values():
                if _covers(e, s.episode) and s.task is not None and not s.task.done():
                    s.retired = True
                    tasks.append(s.task)
        await cancel_and_wait(tasks)
        self.notify_changed()
        return [e.capture_key for e in episodes]


def _covers(retired: EpisodeId, other: EpisodeId) -> bool:
    """Retiring an attempt also retires every earlier attempt of that rollout."""
    return other.rollout_id == retired.rollout_id and other.attempt <= retired.attempt


# -- restart-only agents --------------------------------------------------


class RestartOnlyAgentParticipant(CheckpointParticipant):
    """Participant of an agent that cannot save sessions: tracks each running
    ``/run`` by capture key. Under ``block`` every one blocks a checkpoint (and
    new ones are refused); under ``best_effort`` they are reported unsaved and
    keep running, so the checkpoint is not held up by them."""

    kind = "agent"

    def __init__(self, agent: Any = None):
        super().__init__()
        self.name: str = getattr(agent, "name", None) or "agent"
        self.replayable = declared_replayable(agent)
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        self._retired_tasks: set[asyncio.Task[Any]] = set()
        self._ended = EndedRuns()

    def status_extra(self) -> dict[str, Any]:
        return {"restart_only": True, "replayable": self.replayable}

    @property
    def tracked(self) -> list[str]:
        return sorted(self._tasks)

    def admit(self, episode: EpisodeId) -> None:
        """Refuse retired attempts, duplicates, and (under ``block``) runs while closed."""
        self.check_attempt(episode)
        key = episode.capture_key
        if not self.accepting and self.policy == "block":
            raise AdmissionClosedError(f"{self.name} is closed for a checkpoint; /run {key} refused")
        if key in self._tasks:
            raise RunRequestError(409, "rollout_in_progress", f"{self.name}: a /run for {key} is already running")

    async def track(self, episode: EpisodeId, work: Callable[[], Awaitable[T]]) -> T:
        """Run ``work`` as the tracked task of ``episode`` (retire cancels it)."""
        key = episode.capture_key
        task = asyncio.create_task(work(), name=f"agent-run:{key}")
        self._tasks[key] = task
        self.notify_changed()
        try:
            return await task
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if task in self._retired_tasks and not (me is not None and me.cancelling()):
                raise StaleAttemptError(f"{key} was retired while running on {self.name}") from None
            raise
        finally:
            self._retired_tasks.discard(task)
            if self._tasks.get(key) is task:
                del self._tasks[key]
                self._ended.add(key)
            self.notify_changed()

    async def close_admission(self, policy: RestartOnlyPolicy) -> None:
        self.policy = policy
        self.accepting = False
        self.notify_changed()

    async def open_admission(self) -> None:
        self.accepting = True
        self.notify_changed()

    def readiness(self) -> PrepareReport:
        keys = sorted(self._tasks)
        counts = {"runs": len(keys)}
        if not self.accepting and self.policy == "best_effort":
            return PrepareReport.build([], keys, counts)
        return PrepareReport.build(keys, [], counts)

    def ended_runs(self) -> list[str]:
        return self._ended.keys()

    async def export(self, episodes: list[EpisodeId] | None) -> list[Record]:
        return []  # nothing it runs can be saved

    async def install(self, records: list[Record], replay: Collection[str] = ()) -> list[str]:
        self.refuse_replay(replay, self.name)
        if records:
            raise CheckpointError(
                f"{self.name}: restart-only agent cannot restore sessions ({len(records)} records given)"
            )
        return []

    async def retire(self, episodes: list[EpisodeId]) -> list[str]:
        tasks: list[asyncio.Task[Any]] = []
        for e in episodes:
            self.mark_retired(e)
            for key, task in self._tasks.items():
                if _covers(e, EpisodeId.from_capture_key(key)) and not task.done():
                    self._retired_tasks.add(task)
                    tasks.append(task)
        await cancel_and_wait(tasks)
        self.notify_changed()
        return [e.capture_key for e in episodes]


class RestartOnlyTrackingMiddleware:
    """aiohttp middleware: every ``POST /run`` is admitted and tracked by the
    ``_ng_rollout_id`` in its body (aiohttp keeps the body for the handler)."""

    __middleware_version__ = 1

    def __init__(self, participant: RestartOnlyAgentParticipant, paths: tuple[str, ...] = ("/run",)):
        self.participant = participant
        self.paths = frozenset(paths)

    async def __call__(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        if request.method != "POST" or request.path not in self.paths:
            return await handler(request)
        try:
            body = await request.json()
        except ValueError:
            return await handler(request)  # the handler names the bad body
        try:
            episode, _ = parse_run_body(body)
            self.participant.admit(episode)
            return await self.participant.track(episode, lambda: handler(request))
        except RunRequestError as exc:
            return json_error(exc.status, exc.code, exc.detail)
        except CheckpointError as exc:
            return web.json_response(exc.to_body(), status=exc.status)
