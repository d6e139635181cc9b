"""Checkpoint participant of a resources server (docs/design.md §4.5 "Resources").

It is also the server's table of live sessions, so that admission, readiness
and export all read one source of truth. A session is live from a successful
``/seed_session`` until ``/verify`` or ``/close_session``.

- ``exported`` / ``stateless``: prepare holds new session calls and is ready
  once no call is running; commit exports each session (``state`` is None for
  ``stateless``); restore installs every record under its next attempt with the
  same session id, all or nothing.
- ``restart_only``: the state cannot leave the process. Under policy ``block``
  every live session blocks; under ``best_effort`` they are reported unsaved.
- ``replayed``: restart-only in every respect here; it declares that a session's
  state is a function of the tool calls it received and those calls act nowhere
  else, so RL brings its rollouts back by replaying their model calls into fresh
  sessions (``gym_patches.checkpoint.replay``). ``replayable`` says the same of an
  ``exported`` server (``stateless`` ones are replayable by nature).

In every mode, seeds that arrive while admission is closed wait for resume.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, ClassVar, Collection, Literal

from pydantic import ValidationError

from gym_patches.checkpoint.errors import CheckpointError, StaleAttemptError
from gym_patches.checkpoint.identity import EpisodeId, next_attempt
from gym_patches.checkpoint.participant import CheckpointParticipant, Record
from gym_patches.checkpoint.records import (
    CapturedRecord,
    Fragment,
    RecordEncodeError,
    capture_record,
    check_plain_json,
    plain,
)
from gym_patches.checkpoint.wire import RESTART_ONLY_MODES, PrepareReport, ResourcesCheckpointMode, RestartOnlyPolicy

logger = logging.getLogger(__name__)

CHECKPOINT_MODES: tuple[str, ...] = ("stateless", "exported", "restart_only", "replayed")
RETIRED_SESSIONS_KEPT = 10_000


class UnknownSessionError(LookupError):
    """No live session has this id (never seeded, already ended, or lost with its process)."""


class SessionStateHooks(ABC):
    """What the participant needs from the server that owns the session states."""

    @abstractmethod
    def export_session_state(self, state: Any) -> dict[str, Any] | Fragment:
        """JSON copy of one session's state (``exported`` mode): a dict, or a JSON fragment
        (``records.fragment(model)``, the fast way for a pydantic model). Restore gets a dict."""

    @abstractmethod
    def restore_session_state(self, data: dict[str, Any]) -> Any:
        """Rebuild a state from ``export_session_state`` output; raise ValueError if invalid."""

    @abstractmethod
    async def close_state(self, state: Any) -> None:
        """Free what the state holds (subprocesses, files); must not raise."""


@dataclass
class LiveSession:
    session_id: str
    episode: EpisodeId
    state: Any
    inflight: int = 0
    ended: bool = False  # removed from the table; freed when the last call leaves
    freed: bool = False
    calls: int = 0  # calls begun: a state changes only inside a call, so this versions it
    exported: tuple[int, Any] | None = None  # (calls, export) of the last capture, reused while unchanged
    captured: tuple[int, CapturedRecord] | None = None  # (calls, record) frozen for staged captures, likewise
    key: str = field(init=False)  # the episode's capture key, made once

    def __post_init__(self) -> None:
        self.key = self.episode.capture_key


@dataclass
class _Seed:
    episode: EpisodeId
    token: object = field(default_factory=object)


class ResourcesParticipant(CheckpointParticipant):
    """Live sessions of one resources server plus their checkpoint rules."""

    kind: ClassVar[Literal["resources"]] = "resources"

    def __init__(self, mode: ResourcesCheckpointMode, hooks: SessionStateHooks, *, instance: str = "resources",
                 replayable: bool = False):
        super().__init__()
        if mode not in CHECKPOINT_MODES:
            raise ValueError(f"{instance}: checkpoint_mode must be one of {CHECKPOINT_MODES}, got {mode!r}")
        if mode == "restart_only" and replayable:
            mode = "replayed"  # the declaration is the mode: restart-only, and replayable
        self.mode: ResourcesCheckpointMode = mode
        # Its rollouts can come back by replay: declared (``replayed``, or ``replayable`` on a saving
        # server), or by nature (``stateless``). Only the status says it; nothing here acts on it.
        self.replayable = mode in ("replayed", "stateless") or bool(replayable)
        self.restart_only = mode in RESTART_ONLY_MODES
        self.hooks = hooks
        # A server whose session states name what only its process has (a local file, a handle) says so.
        self.records_portable = bool(getattr(hooks, "records_portable", True))
        self.instance = instance
        self.sessions: dict[str, LiveSession] = {}
        self._seeding: dict[object, _Seed] = {}
        self._waiting = 0
        self._open = asyncio.Event()
        self._open.set()
        # session id -> capture key of sessions retired here (a later call gets stale_attempt)
        self._retired_sessions: OrderedDict[str, str] = OrderedDict()
        # Kept on every call, so readiness and a capture look only at what blocks or changed instead of
        # scanning every session while rollouts are held: the live sessions with a call in flight; and
        # (``exported``) every idle live session in exactly one of: its record frozen since its last
        # call (what a capture hands over as it is), or not (``close_admission`` and a capture make those).
        self._busy: dict[str, LiveSession] = {}
        self._busy_calls = 0  # their calls in flight
        self._records: dict[str, CapturedRecord] = {}
        self._unexported: dict[str, LiveSession] = {}

    # -- admission ---------------------------------------------------------
    @property
    def holds_session_calls(self) -> bool:
        """Only modes that save state must keep tool calls out of a snapshot."""
        return not self.restart_only

    async def close_admission(self, policy: RestartOnlyPolicy) -> None:
        self.policy = policy
        self.accepting = False
        self.capture_eagerly = True
        self._open.clear()
        for session in list(self._unexported.values()):  # the others were exported after their last call
            self._precapture(session)
        self.notify_changed()

    def _precapture(self, session: LiveSession) -> None:
        """Export an idle session ahead of the capture (which then reuses it): while closed, and,
        once a checkpoint has been prepared, after every seed and call (``capture_eagerly``), so little of
        that work is left for the time every rollout is held. Failures are left for the capture."""
        if self.mode == "exported" and session.inflight == 0 and not session.ended:
            try:
                self._captured(session)
            except Exception:
                session.exported = session.captured = None

    async def open_admission(self) -> None:
        self.accepting = True
        self._open.set()
        self.notify_changed()

    async def _wait_open(self) -> None:
        self._waiting += 1
        try:
            while not self.accepting:
                await self._open.wait()
        finally:
            self._waiting -= 1

    def readiness(self) -> PrepareReport:
        seeding = [s.episode.capture_key for s in self._seeding.values()]
        inflight = self._busy_calls + len(seeding)
        counts = {"inflight": inflight, "sessions": len(self.sessions), "waiting": self._waiting}
        if self.restart_only:
            live = [s.key for s in self.sessions.values()] + seeding
            if self.policy == "best_effort":
                return PrepareReport.build([], unsaved=live, counts=counts)
            return PrepareReport.build(live, counts=counts)
        # A seed in flight builds a session no agent has a boundary for yet (its run is not started,
        # the agent reports it unsaved): it never blocks readiness, and a capture leaves it out.
        busy = [s.key for s in self._busy.values()]
        return PrepareReport.build(busy, counts=counts)

    def is_ready(self) -> bool:
        if self.restart_only:
            return self.policy == "best_effort" or not (self.sessions or self._seeding)
        return not self._busy

    def status_extra(self) -> dict[str, Any]:
        return {"mode": self.mode, "replayable": self.replayable}

    # -- session lifecycle (called by the server's routes) --------------------
    @contextlib.asynccontextmanager
    async def seeding(self, episode: EpisodeId) -> AsyncIterator[None]:
        """Wrap building a new session's state: waits while closed, refuses retired attempts."""
        await self._wait_open()
        self.check_attempt(episode)
        seed = _Seed(episode)
        self._seeding[seed.token] = seed
        self.notify_changed()
        try:
            yield
        finally:
            del self._seeding[seed.token]
            self.notify_changed()

    def add_session(self, session_id: str, episode: EpisodeId, state: Any) -> LiveSession:
        """Make a freshly seeded state live. Raises ``stale_attempt`` if retired meanwhile
        (the caller then frees the state itself)."""
        self.check_attempt(episode)
        if session_id in self.sessions:
            raise CheckpointError(f"{self.instance}: session {session_id!r} is already live")
        session = LiveSession(session_id, episode, state)
        self._list(session)
        if self.capture_eagerly:  # as after a call: a close during a burst of seeds finds them exported
            self._precapture(session)
        self.notify_changed()
        return session

    def _list(self, session: LiveSession) -> None:
        self.sessions[session.session_id] = session
        if self.mode == "exported":
            self._unexported[session.session_id] = session

    def lookup(self, session_id: str | None) -> LiveSession:
        """The live session, or ``stale_attempt`` / ``UnknownSessionError``."""
        if session_id:
            session = self.sessions.get(session_id)
            if session is not None:
                self.check_attempt(session.episode)
                return session
            retired_key = self._retired_sessions.get(session_id)
            if retired_key is not None:
                raise StaleAttemptError(f"{self.instance}: session {session_id!r} of {retired_key} was retired")
        shown = "no session cookie" if not session_id else f"session {session_id!r} is not live"
        raise UnknownSessionError(f"{self.instance}: {shown}; call /seed_session first")

    @contextlib.asynccontextmanager
    async def session_call(self, session_id: str | None) -> AsyncIterator[LiveSession]:
        """Wrap one call on a session (tool, verify, close). In saving modes it waits
        while closed and counts as in flight while it runs."""
        self.lookup(session_id)
        if self.holds_session_calls and not self.accepting:
            await self._wait_open()
        session = self.lookup(session_id)  # it may have been retired while we waited
        session.inflight += 1
        session.calls += 1
        self._busy[session.session_id] = session  # lookup found it live
        self._busy_calls += 1
        self._records.pop(session.session_id, None)
        self._unexported.pop(session.session_id, None)
        self.notify_changed()
        try:
            yield session
        finally:
            session.inflight -= 1
            if self._busy.get(session.session_id) is session:  # still live
                self._busy_calls -= 1
                if session.inflight == 0:
                    del self._busy[session.session_id]
                    if self.mode == "exported":
                        self._unexported[session.session_id] = session  # until exported below
            if self.capture_eagerly or not self.accepting:
                self._precapture(session)
            self.notify_changed()
            if session.ended and session.inflight == 0:
                await self._free(session)

    async def end_session(self, session: LiveSession) -> None:
        """Forget a session (after verify/close); its state is freed once no call uses it."""
        if self.sessions.get(session.session_id) is session:
            del self.sessions[session.session_id]
            if self._busy.pop(session.session_id, None) is not None:
                self._busy_calls -= session.inflight
            self._records.pop(session.session_id, None)
            self._unexported.pop(session.session_id, None)
        session.ended = True
        self.notify_changed()
        if session.inflight == 0:
            await self._free(session)

    async def _free(self, session: LiveSession) -> None:
        if not session.freed:
            session.freed = True
            try:
                await self.hooks.close_state(session.state)
            except Exception:  # freeing is best effort; the session is gone either way
                logger.exception("%s: freeing session %s failed", self.instance, session.session_id)

    async def shutdown(self) -> None:
        """Free every live session (server cleanup)."""
        for session in list(self.sessions.values()):
            await self.end_session(session)

    # -- checkpoint lifecycle ---------------------------------------------------
    def forget(self, rollout_ids: set[str]) -> int:
        gone = [sid for sid, key in self._retired_sessions.items()
                if EpisodeId.from_capture_key(key).rollout_id in rollout_ids]
        for session_id in gone:
            del self._retired_sessions[session_id]
        return len(gone) + super().forget(rollout_ids)

    async def export(self, episodes: list[EpisodeId] | None) -> list[Record]:
        if self.restart_only:
            return []
        scope = None if episodes is None else {e.capture_key for e in episodes}
        records: list[Record] = []
        for session in sorted(self.sessions.values(), key=lambda s: s.session_id):
            key = session.episode.capture_key
            if scope is not None and key not in scope:
                continue  # the commit scope spans every server; other rollouts live elsewhere
            if session.inflight:
                raise CheckpointError(f"{self.instance}: session {session.session_id!r} of {key} has a call in flight")
            records.append(self._record(session))
        return records

    async def capture_records(self) -> list[Any]:
        """Each session's ``CapturedRecord``, kept while no call has begun on it (most were made as
        their last call ended); a state given as Python objects goes as a plain record."""
        if self.restart_only:
            return []
        if self._busy:
            session = next(s for s in self.sessions.values() if s.inflight)  # the first, as a scan finds it
            raise CheckpointError(f"{self.instance}: session {session.session_id!r} of "
                                  f"{session.episode.capture_key} has a call in flight")
        if self.mode == "exported":
            out: list[Any] = list(self._records.values())
            return out + [self._captured(session) for session in list(self._unexported.values())]
        return [self._captured(session) for session in self.sessions.values()]

    def _record(self, session: LiveSession) -> Record:
        state = None if self.mode == "stateless" else self._export_state(session)
        return {"episode_id": {"rollout_id": session.episode.rollout_id, "attempt": session.episode.attempt},
                "session_id": session.session_id, "state": state}

    def _captured(self, session: LiveSession) -> CapturedRecord | Record:
        cached = session.captured
        if cached is not None and cached[0] == session.calls:
            return cached[1]
        record = self._record(session)
        entry = capture_record(record)
        if entry is None:
            return record  # Python objects: the capture encodes it
        session.captured = (session.calls, entry)
        if self.mode == "exported" and session.inflight == 0 and self.sessions.get(session.session_id) is session:
            self._records[session.session_id] = entry
            self._unexported.pop(session.session_id, None)
        return entry

    def _export_state(self, session: LiveSession) -> Any:
        """The hook's export, reused while no call has begun on the session since it was taken.
        One given as Python objects must be plain JSON (checked once per export)."""
        if session.exported is None or session.exported[0] != session.calls:
            state = self.hooks.export_session_state(session.state)
            if not isinstance(state, Fragment):
                try:
                    check_plain_json(state, "state")
                except RecordEncodeError as exc:
                    raise CheckpointError(
                        f"{self.instance}: session {session.session_id!r} of {session.episode.capture_key} "
                        f"exported a state that is not plain JSON: {exc}"
                    ) from None
            session.exported = (session.calls, state)
        return session.exported[1]

    async def install(self, records: list[Record], replay: Collection[str] = ()) -> list[str]:
        self.refuse_replay(replay, self.instance)
        if records and self.restart_only:
            raise CheckpointError(
                f"{self.instance} is {self.mode}: its sessions cannot be restored "
                f"({len(records)} record(s) offered)"
            )
        parsed = [self._parse_record(index, record) for index, record in enumerate(records)]
        repeated = sorted(i for i, n in Counter(sid for sid, _, _ in parsed).items() if n > 1)
        if repeated:
            raise CheckpointError(f"{self.instance}: records repeat session id(s) {repeated[:10]}")
        built: list[tuple[str, EpisodeId, Any]] = []
        try:
            for index, (session_id, episode, data) in enumerate(parsed):
                if self.mode == "stateless":
                    state = None
                else:
                    try:
                        state = self.hooks.restore_session_state(data)
                    except (ValueError, TypeError) as exc:
                        raise CheckpointError(
                            f"{self.instance}: record {index} (session {session_id!r}) has an invalid state: {exc}"
                        ) from None
                built.append((session_id, episode, state))
        except BaseException:
            for _, _, state in built:
                with contextlib.suppress(Exception):
                    await self.hooks.close_state(state)
            raise
        for session_id, episode, state in built:
            self._list(LiveSession(session_id, episode, state))
        self.notify_changed()
        keys: list[str] = []
        for _, episode, _ in built:
            if episode.capture_key not in keys:
                keys.append(episode.capture_key)
        return keys

    def _parse_record(self, index: int, record: Record) -> tuple[str, EpisodeId, Any]:
        where = f"{self.instance}: record {index}"
        if not isinstance(record, dict):
            raise CheckpointError(f"{where} is not a JSON object")
        record = plain(record)
        unknown = sorted(set(record) - {"episode_id", "session_id", "state"})
        if unknown:
            raise CheckpointError(f"{where} has unknown field(s) {unknown}")
        try:
            old = EpisodeId.model_validate(record.get("episode_id"))
        except ValidationError:
            raise CheckpointError(f"{where} has no valid episode_id") from None
        session_id = record.get("session_id")
        if not isinstance(session_id, str) or not session_id:
            raise CheckpointError(f"{where} ({old}) has no valid session_id")
        if session_id in self.sessions:
            raise CheckpointError(f"{where}: session {session_id!r} is already live here; restore needs a fresh server")
        state = record.get("state", ...)
        if self.mode == "stateless" and state is not None:
            raise CheckpointError(f"{where} ({old}) carries a state, but {self.instance} is stateless")
        if self.mode == "exported" and not isinstance(state, dict):
            raise CheckpointError(f"{where} ({old}) has no state object")
        episode = next_attempt(old)
        try:
            self.check_attempt(episode)
        except CheckpointError as exc:
            raise CheckpointError(f"{where}: {exc.detail}", code=exc.code) from None
        return session_id, episode, state

    async def retire(self, episodes: list[EpisodeId]) -> list[str]:
        for episode in episodes:
            self.mark_retired(episode)
        for session in list(self.sessions.values()):
            highest = self.retired.get(session.episode.rollout_id)
            if highest is not None and session.episode.attempt <= highest:
                self._retired_sessions[session.session_id] = session.episode.capture_key
                while len(self._retired_sessions) > RETIRED_SESSIONS_KEPT:
                    self._retired_sessions.popitem(last=False)
                await self.end_session(session)
        return [e.capture_key for e in episodes]
