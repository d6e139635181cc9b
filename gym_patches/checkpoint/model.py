"""Checkpoint participant of the policy model server, and its admission gate.

docs/design.md §4.5 "Model": a checkpoint must see every agent at a boundary, so
once prepare closes admission the model hands out no reply: a reply that
finishes while closed is *held* until resume, and calls that arrive while
closed wait. Only a reply already being written blocks readiness. Generation
itself never blocks: the agent waiting on it counts as parked at its last
boundary and re-issues the call after a restore.

The server drives one call through the gate like this::

    async with participant.call(capture_key) as ticket:   # waits while closed
        reply = await participant.run(ticket, backend_call())  # retire cancels it
        await participant.release_response(ticket)      # held while closed
        ...write the reply...
        participant.delivered(ticket)

Records: per episode, how many replies it has received, and, when the prepare
asked for a *generation cut* (``target_level: prefix``) and named the episode's
rollout among the prefix-level ones (``cut_rollouts``), the tokens its call in
flight had decoded when admission closed (``gym_patches.checkpoint.cuts``). A
restored episode's next call continues from its cut, once; a cut that cannot
be taken never blocks the prepare (those calls regenerate at turn level).
With ``record_calls`` the record also carries the episode's finished calls
(``gym_patches.checkpoint.replay``): a restore that names the episode for
replay answers its calls from them while the agent runs again from its prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Collection, Literal, Protocol, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gym_patches.checkpoint.control.scope import TASK_NAME_PREFIX
from gym_patches.utils.cancellation import outlast_cancellation
from gym_patches.checkpoint.cuts import CutSummary, GenerationCut
from gym_patches.checkpoint.errors import CheckpointError, StaleAttemptError
from gym_patches.checkpoint.identity import EpisodeId, next_attempt
from gym_patches.checkpoint.participant import CheckpointParticipant, Record
from gym_patches.checkpoint.records import CapturedRecord, Fragment, capture_record, fragment, plain
from gym_patches.checkpoint.replay import CallBook, CallPlan, RecordedCall, ReplayStats
from gym_patches.checkpoint.wire import PrepareReport, RestartOnlyPolicy

T = TypeVar("T")
TicketState = Literal["waiting", "generating", "held", "writing"]


logger = logging.getLogger(__name__)


class CutSource(Protocol):
    """The backend's generation cuts (``gym_patches.checkpoint.cuts``): pin in the pause, fetch after."""

    async def pin(self, pin: str, call_ids: list[str]) -> dict[str, int]: ...

    async def fetch(self, pin: str) -> dict[str, GenerationCut]: ...


@dataclass
class _PendingCut:
    """A prepare's cut: the calls it noted (call id -> episode) and the task pinning them at the backend."""

    pin: str
    calls: dict[str, EpisodeId]
    task: asyncio.Future[dict[str, int]]


def _observed(task: asyncio.Future) -> None:
    """A pin's failure is reported where its tokens are asked for; one nobody asks for is not an error."""
    if not task.cancelled():
        task.exception()


class ModelRecord(BaseModel):
    """What the model saves per episode: replies delivered, the cut of the call in flight, if any
    (the call numbered ``delivered_calls``; ``cut_tokens`` is its token count, 0 without a cut), and,
    with ``record_calls``, the finished calls from call 0 on (``calls``: a gapless prefix of the
    trajectory; more than ``delivered_calls`` while a replay has calls still queued)."""

    model_config = ConfigDict(extra="forbid")

    episode_id: EpisodeId
    delivered_calls: int = Field(ge=0)
    cut: GenerationCut | None = None
    cut_tokens: int = Field(default=0, ge=0)
    calls: list[RecordedCall] = Field(default_factory=list)

    @model_validator(mode="after")
    def _count_matches(self) -> "ModelRecord":
        if self.cut_tokens != (0 if self.cut is None else self.cut.token_count):
            raise ValueError("cut_tokens must equal cut.token_count (0 without a cut)")
        return self


@dataclass(eq=False)
class ModelTicket:
    """One generation call. ``episode`` is None for calls outside ``/ng-rollout/``."""

    ticket_id: int
    episode: EpisodeId | None
    admitted_at: float
    state: TicketState = "waiting"
    retired: bool = False
    call_id: str | None = None  # the backend call's X-NG-Call-Id, set once it is sent
    task: asyncio.Future[Any] | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    plan: CallPlan | None = None  # replayed or live (``plan_call``); None: not asked

    @property
    def capture_key(self) -> str | None:
        return None if self.episode is None else self.episode.capture_key

    def covered_by(self, episode: EpisodeId) -> bool:
        return (
            self.episode is not None
            and self.episode.rollout_id == episode.rollout_id
            and self.episode.attempt <= episode.attempt
        )


class _CallCounts(dict):
    """Delivered calls per episode that notes every episode written or removed since
    ``take_written``, so a capture remakes the records of those alone."""

    def __init__(self) -> None:
        super().__init__()
        self._written: set[EpisodeId] = set()

    def __setitem__(self, episode: EpisodeId, calls: int) -> None:
        super().__setitem__(episode, calls)
        self._written.add(episode)

    def __delitem__(self, episode: EpisodeId) -> None:
        super().__delitem__(episode)
        self._written.add(episode)

    def touch(self, episode: EpisodeId) -> None:
        """Its record changed without a new count (a divergence dropped its queued calls)."""
        self._written.add(episode)

    def take_written(self) -> set[EpisodeId]:
        written, self._written = self._written, set()
        return written


def _model_record(episode: EpisodeId, delivered_calls: int, cut: GenerationCut | None = None,
                  calls: tuple[Fragment, ...] = ()) -> Record:
    """The dump of a ``ModelRecord``, built directly (captures run while rollouts are held); a cut goes
    in as a JSON fragment (its packed tokens are one string each), the recorded calls as the fragments
    each was serialised to when it was delivered (a capture copies references, never their bytes)."""
    record: Record = {"episode_id": {"rollout_id": episode.rollout_id, "attempt": episode.attempt},
                      "delivered_calls": delivered_calls}
    if cut is not None:
        record["cut"] = fragment(cut)
        record["cut_tokens"] = cut.token_count
    if calls:
        record["calls"] = calls
    return record


class PolicyModelParticipant(CheckpointParticipant):
    """Admission gate + checkpoint participant (kind ``model``)."""

    kind = "model"

    def __init__(self) -> None:
        super().__init__()
        self._ids = itertools.count(1)
        self._tickets: dict[int, ModelTicket] = {}
        # The admitted tickets by state, kept on every move, so readiness counts without a scan.
        self._by_state: dict[str, dict[int, ModelTicket]] = {state: {} for state in get_args(TicketState)}
        self._delivered = _CallCounts()
        # Each counted episode's record as a capture takes it: a capture remakes only those whose count
        # was written since (docs/design.md §5.4), not a pass over every episode.
        self._capture_cache: dict[EpisodeId, CapturedRecord] = {}
        # Generation cuts: how to take them (the server's backend; None: not supported), those the
        # current prepare took (per episode, until reopen), and restored ones waiting for their call.
        self.cut_source: CutSource | None = None
        self.cut_timeout_s = 2.0
        self._pins = itertools.count(1)
        self._cut: _PendingCut | None = None  # the newest prepare's cut, until its tokens are asked for
        self._pinning: set[asyncio.Task[dict[str, int]]] = set()  # pin tasks not ended yet: ``stop`` ends them
        self._cut_summary: CutSummary | None = None
        self._restored_cuts: dict[EpisodeId, tuple[int, GenerationCut]] = {}
        # The newest fetched cut of each call still in flight (by call id): a call sent again because its
        # backend was lost continues from it (``newest_cut``); dropped as its call ends.
        self._live_cuts: dict[str, GenerationCut] = {}
        # Each episode's finished calls (``record_calls``) and replay queue (``gym_patches.checkpoint.replay``).
        self.calls = CallBook()

    @property
    def record_calls(self) -> bool:
        return self.calls.recording

    @record_calls.setter
    def record_calls(self, on: bool) -> None:
        self.calls.recording = bool(on)

    # -- the gate ----------------------------------------------------------
    @contextlib.asynccontextmanager
    async def call(self, capture_key: str | None) -> AsyncIterator[ModelTicket]:
        """Admit one call (waiting while closed); the ticket lives until exit.

        Raises ``StaleAttemptError`` for a retired attempt, also one retired
        while it waited.
        """
        episode = None if capture_key is None else EpisodeId.from_capture_key(capture_key)
        if episode is not None:
            self.check_attempt(episode)
        ticket = ModelTicket(ticket_id=next(self._ids), episode=episode, admitted_at=time.time())
        self._tickets[ticket.ticket_id] = ticket
        self._by_state[ticket.state][ticket.ticket_id] = ticket
        self.notify_changed()
        try:
            await self._wait_open(ticket)
            self._set_state(ticket, "generating")
            self.notify_changed()
            yield ticket
        finally:
            if self._tickets.pop(ticket.ticket_id, None) is not None:
                del self._by_state[ticket.state][ticket.ticket_id]
            if ticket.call_id is not None:
                self._live_cuts.pop(ticket.call_id, None)
            self.notify_changed()

    def _set_state(self, ticket: ModelTicket, state: TicketState) -> None:
        if ticket.state != state:
            by_state = self._by_state
            if by_state[ticket.state].pop(ticket.ticket_id, None) is not None:
                by_state[state][ticket.ticket_id] = ticket
            ticket.state = state

    async def run(self, ticket: ModelTicket, work: Awaitable[T]) -> T:
        """Run the backend call; ``retire`` cancels it (-> ``StaleAttemptError``)."""
        try:
            self._raise_if_retired(ticket)
        except StaleAttemptError:
            if asyncio.iscoroutine(work):
                work.close()  # never started: do not leave it un-awaited
            raise
        task = asyncio.ensure_future(work)
        ticket.task = task
        try:
            return await task
        except asyncio.CancelledError:
            if ticket.retired and task.cancelled():
                self._raise_if_retired(ticket)
            raise
        finally:
            ticket.task = None

    async def release_response(self, ticket: ModelTicket) -> None:
        """Hold a finished reply while admission is closed; then mark it writing."""
        await self._wait_open(ticket, state="held")
        self._set_state(ticket, "writing")
        self.notify_changed()

    def plan_call(self, ticket: ModelTicket, body: dict[str, Any]) -> CallPlan:
        """Whether the admitted call ``ticket`` (its request ``body`` as sent) is answered from its
        episode's record (a replay) or generated live; a divergence is noted here."""
        episode = ticket.episode
        if episode is None:
            return CallPlan(index=-1)
        plan = self.calls.plan(episode, self._delivered.get(episode, 0), body)
        if plan.divergence is not None:
            self._delivered.touch(episode)  # its record lost the calls it queued
        ticket.plan = plan
        return plan

    def delivered(self, ticket: ModelTicket, reply: bytes | None = None) -> None:
        """The reply reached the caller: count it for the episode's record, and record the call
        (``reply``: its bytes as sent, without any replay annotation) when calls are recorded."""
        if ticket.episode is None or ticket.retired:
            return
        with contextlib.suppress(StaleAttemptError):
            self.check_attempt(ticket.episode)
            if ticket.plan is not None:
                self.calls.delivered(ticket.episode, ticket.plan, reply)
            self._delivered[ticket.episode] = self._delivered.get(ticket.episode, 0) + 1

    async def _wait_open(self, ticket: ModelTicket, state: TicketState | None = None) -> None:
        while True:
            self._raise_if_retired(ticket)
            if self.accepting:
                return
            ticket.wake.clear()
            if state is not None and ticket.state != state:
                self._set_state(ticket, state)
                self.notify_changed()
            await ticket.wake.wait()

    def _raise_if_retired(self, ticket: ModelTicket) -> None:
        if ticket.retired:
            raise StaleAttemptError(f"model call of episode {ticket.capture_key} was cancelled: its attempt was retired")
        if ticket.episode is not None:
            self.check_attempt(ticket.episode)

    def _wake_all(self) -> None:
        """Wake every call waiting for reopen: those are exactly the waiting and held tickets."""
        for state in ("waiting", "held"):
            for ticket in self._by_state[state].values():
                ticket.wake.set()

    # -- participant -------------------------------------------------------
    async def close_admission(self, policy: RestartOnlyPolicy) -> None:
        self.policy = policy
        self.accepting = False
        self.notify_changed()

    async def open_admission(self) -> None:
        self.accepting = True
        self._cut_summary = None  # the cut itself stays: a staged capture fetches its tokens after resume
        self._wake_all()
        self.notify_changed()

    # -- generation cuts -----------------------------------------------------
    async def take_cut(self, rollouts: Collection[str] | None = None) -> CutSummary:
        """Note every tracked call generating now and start pinning them at the backend (the calls go on
        untouched). Nothing here waits on the backend, so the cut adds nothing to the pause: the pin lands
        a round trip later, while the calls still decode (any prefix of a call's own tokens is a valid
        cut: the restored call continues from it and only the rest is decoded again), and the tokens are
        fetched after resume (``capture_completion``) or by a blocking commit's ``export``. A backend
        without cuts is reported here; a pin or fetch that fails, when the tokens are asked for.

        ``rollouts``: only calls of these rollout ids (any attempt) are cut, the prefix-level ones; a
        call of any other rollout is never noted (docs/design.md §5.10). None: every call in flight."""
        wanted = None if rollouts is None else set(rollouts)
        calls = {t.call_id: t.episode for t in self._by_state["generating"].values()
                 if t.episode is not None and t.call_id is not None and not t.retired
                 and (wanted is None or t.episode.rollout_id in wanted)}
        summary = CutSummary(in_flight=len(calls))
        if self._cut is not None:
            self._cut.task.cancel()  # an older cut nobody asked the tokens of
        self._cut = None
        if calls and self.cut_source is None:
            summary.error = "the model server's backend does not support generation cuts"
        elif calls:
            pin = f"cut-{next(self._pins)}"
            task = asyncio.create_task(self._pin(pin, list(calls)), name=f"{TASK_NAME_PREFIX}cut-pin:{pin}")
            task.add_done_callback(_observed)
            task.add_done_callback(self._pinning.discard)
            self._pinning.add(task)
            self._cut = _PendingCut(pin, calls, task)
        self._cut_summary = summary
        return summary

    async def stop(self) -> None:
        """The server is stopping: cancel every pin still running and wait until each has ended (a
        cancellation of this wait is raised only after)."""
        self._cut = None
        tasks = [task for task in self._pinning if not task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await outlast_cancellation(asyncio.gather(*tasks, return_exceptions=True))

    async def _pin(self, pin: str, call_ids: list[str]) -> dict[str, int]:
        assert self.cut_source is not None
        return await asyncio.wait_for(self.cut_source.pin(pin, call_ids), self.cut_timeout_s)

    def cut_summary(self) -> CutSummary | None:
        """What the current prepare's cut noted (None: none was asked for)."""
        return self._cut_summary

    def _cut_episodes(self) -> set[EpisodeId]:
        return set() if self._cut is None else set(self._cut.calls.values())

    async def _cuts_of(self, cut: "_PendingCut | None") -> tuple[dict[EpisodeId, GenerationCut], int, str | None]:
        """The pinned calls' cuts (each checked against its pinned count), how many calls in flight got none
        though the backend was asked, and why; the owner of the pin task (it is awaited or cancelled here)."""
        if cut is None:
            return {}, 0, None
        try:
            counts = await cut.task
            got = await asyncio.wait_for(self.cut_source.fetch(cut.pin), self.cut_timeout_s * 5) if counts else {}
        except asyncio.CancelledError:
            if not cut.task.cancelled():
                raise
            return {}, len(cut.calls), "the cut was superseded by a newer one before its tokens were fetched"
        except asyncio.TimeoutError:
            why = f"the backend did not answer the cut within {self.cut_timeout_s:g}s"
        except Exception as exc:  # noqa: BLE001 - a lost cut costs its calls' tokens, never the snapshot
            why = f"{type(exc).__name__}: {exc}"[:500]
        else:
            out = {}
            live = {t.call_id for t in self._tickets.values() if t.call_id is not None}
            for call_id, episode in cut.calls.items():
                c, n = got.get(call_id), counts.get(call_id)
                if c is not None and c.call_id == call_id and c.token_count == n:
                    out[episode] = c
                    if call_id in live:
                        self._live_cuts[call_id] = c
            return out, len(counts) - len(out), None  # calls with no token yet had nothing to save
        logger.warning("generation cut %s: %d calls regenerate at turn level: %s", cut.pin, len(cut.calls), why)
        return {}, len(cut.calls), why

    def capture_completion(self) -> Callable[[], Awaitable[tuple[dict[str, Record], int, str | None]]] | None:
        """For a staged capture taken now: after resume, the fields its cut episodes' records gain (the cut
        and its token count, by capture key), the calls that got no cut, and why."""
        cut = self._cut
        if cut is None:
            return None

        async def complete() -> tuple[dict[str, Record], int, str | None]:
            cuts, failed, why = await self._cuts_of(cut)
            return ({e.capture_key: {"cut": fragment(c), "cut_tokens": c.token_count} for e, c in cuts.items()},
                    failed, why)

        return complete

    def newest_cut(self, call_id: str | None) -> GenerationCut | None:
        """The newest cut fetched of the call ``call_id`` while it is in flight (None: none was taken): what
        the call continues from when it is sent again to a backend that replaced a lost one."""
        return None if call_id is None else self._live_cuts.get(call_id)

    def take_restored_cut(self, episode: EpisodeId) -> GenerationCut | None:
        """The cut a restore installed for ``episode``'s next call, handed out once; dropped unused if
        the episode's next call is not the one it was cut from."""
        entry = self._restored_cuts.pop(episode, None)
        if entry is None:
            return None
        call_index, cut = entry
        return cut if self._delivered.get(episode, 0) == call_index else None

    def readiness(self) -> PrepareReport:
        """Ready unless a tracked reply is being written. Generating and held
        calls never block: their agents are still at their last boundary."""
        by_state = self._by_state
        counts = {"waiting": len(by_state["waiting"]), "inflight": len(by_state["generating"]),
                  "held": len(by_state["held"]), "writing": len(by_state["writing"])}
        blockers = [t.capture_key for t in by_state["writing"].values() if t.episode is not None]
        return PrepareReport.build(blockers, counts=counts)

    def is_ready(self) -> bool:
        return not any(t.episode is not None for t in self._by_state["writing"].values())

    def status_extra(self) -> dict[str, Any]:
        return {"accepting": self.accepting, "replay": self.replay_stats().model_dump()}

    def replay_stats(self) -> ReplayStats:
        return self.calls.stats()

    def forget(self, rollout_ids: set[str]) -> int:
        gone = [e for e in self._delivered if e.rollout_id in rollout_ids]
        for episode in gone:
            del self._delivered[episode]
        cuts = [e for e in self._restored_cuts if e.rollout_id in rollout_ids]
        for episode in cuts:  # a trained or abandoned rollout's prefix is never continued
            del self._restored_cuts[episode]
        books = self.calls.drop(lambda e: e.rollout_id in rollout_ids)  # its calls are never replayed
        return len(gone) + len(cuts) + books + super().forget(rollout_ids)

    async def export(self, episodes: list[EpisodeId] | None) -> list[Record]:
        """One record per episode. Without a scope: every episode with delivered
        replies. With a scope: every in-scope episode that is not retired, also
        those with 0 delivered (an agent parked at its first call), so a restore
        of that scope always finds a record. Cut episodes carry their cut, fetched now (a blocking commit
        writes inside the pause anyway)."""
        pending, self._cut = self._cut, None
        cuts, _, _ = await self._cuts_of(pending)
        if episodes is None:
            chosen = {e: n for e, n in self._delivered.items() if n > 0 or self.calls.has_calls(e)}
            for episode in cuts:
                chosen.setdefault(episode, self._delivered.get(episode, 0))
        else:
            chosen = {}
            for episode in episodes:
                with contextlib.suppress(StaleAttemptError):
                    self.check_attempt(episode)
                    chosen[episode] = self._delivered.get(episode, 0)
        return [_model_record(e, n, cuts.get(e), self.calls.calls_of(e))
                for e, n in sorted(chosen.items(), key=lambda kv: kv[0].capture_key)]

    async def capture_records(self) -> list[Any]:
        """``export(None)`` as ``CapturedRecord``s, in no particular order (the capture keys them by
        capture key). Only the episodes counted since the last capture get a record made; the rest
        are the cache's, taken as a whole."""
        cache = self._capture_cache
        for episode in self._delivered.take_written():
            calls = self._delivered.get(episode, 0)
            recorded = self.calls.calls_of(episode)  # references to the fragments made at delivery
            if calls > 0 or recorded:
                entry = capture_record(_model_record(episode, calls, calls=recorded))
                assert entry is not None, f"the record of {episode} cannot be captured"
                cache[episode] = entry
            else:
                cache.pop(episode, None)
        cuts = self._cut_episodes()
        if not cuts:
            return list(cache.values())
        out: list[Any] = [entry for episode, entry in cache.items() if episode not in cuts]
        for episode in cuts:  # its cut joins after resume (``capture_completion``); never cached
            entry = capture_record(_model_record(episode, self._delivered.get(episode, 0),
                                                 calls=self.calls.calls_of(episode)))
            assert entry is not None, f"the record of {episode} cannot be captured"
            out.append(entry)
        return out

    def scope_fill(self) -> Callable[[EpisodeId], Record | None]:
        """An in-scope episode with no delivered reply (its agent parked at its first call) gets a
        record of 0 calls unless it was retired, as ``export`` gives it; judged on the retired
        attempts as they were when prepared (a copy: retire runs again after resume)."""
        retired = dict(self.retired)

        def fill(episode: EpisodeId) -> Record | None:  # a cut episode is captured already
            highest = retired.get(episode.rollout_id)
            return None if highest is not None and episode.attempt <= highest else _model_record(episode, 0)

        return fill

    async def install(self, records: list[Record], replay: Collection[str] = ()) -> list[str]:
        """Install each record under ``next_attempt``; the old attempt is
        superseded and refused from now on. All or nothing.

        ``replay``: capture keys of saved episodes whose agent starts again from the prompt (their
        restart-only servers are replayable): the new attempt counts its calls from 0 and answers
        them from the record's ``calls`` while they match (``gym_patches.checkpoint.replay``). The
        others continue at their turn, after ``delivered_calls``."""
        parsed: list[tuple[ModelRecord, list[dict[str, Any]]]] = []
        for index, record in enumerate(records):
            record = plain(record) if type(record) is dict else record
            try:
                parsed.append((ModelRecord.model_validate(record), list(record.get("calls") or [])))
            except ValidationError as exc:
                fields = "; ".join(f"{'.'.join(map(str, e['loc'])) or '<record>'}: {e['msg']}" for e in exc.errors())
                raise CheckpointError(f"model record {index} is invalid: {fields}") from None
        unknown = set(replay) - {rec.episode_id.capture_key for rec, _ in parsed}
        if unknown:
            raise CheckpointError(f"replay names episodes this restore has no record of: {sorted(unknown)[:10]}")
        for rec, _ in parsed:
            self.check_attempt(next_attempt(rec.episode_id))
        installed = []
        for rec, calls in parsed:
            self._cancel_covered(rec.episode_id)
            self.mark_retired(rec.episode_id)
            new = next_attempt(rec.episode_id)
            replayed = rec.episode_id.capture_key in replay
            self.calls.install(new, calls, rec.calls, replay=replayed, delivered=rec.delivered_calls)
            self._delivered[new] = 0 if replayed else rec.delivered_calls
            if rec.cut is not None:  # a replay reaches the cut call after replaying the calls before it
                self._restored_cuts[new] = (rec.delivered_calls, rec.cut)
            installed.append(new.capture_key)
        return installed

    async def retire(self, episodes: list[EpisodeId]) -> list[str]:
        for episode in episodes:
            self._cancel_covered(episode)
            self.mark_retired(episode)
        return [e.capture_key for e in episodes]

    def _cancel_covered(self, episode: EpisodeId) -> None:
        """Cancel every ticket of ``episode``'s rollout at or below its attempt."""
        for ticket in self._tickets.values():
            if ticket.covered_by(episode) and ticket.state != "writing":
                ticket.retired = True
                if ticket.task is not None and not ticket.task.done():
                    ticket.task.cancel()
                ticket.wake.set()
        for key in [e for e in self._delivered if e.rollout_id == episode.rollout_id and e.attempt <= episode.attempt]:
            del self._delivered[key]
        for key in [e for e in self._restored_cuts
                    if e.rollout_id == episode.rollout_id and e.attempt <= episode.attempt]:
            del self._restored_cuts[key]
        self.calls.drop(lambda e: e.rollout_id == episode.rollout_id and e.attempt <= episode.attempt)
        self.notify_changed()
