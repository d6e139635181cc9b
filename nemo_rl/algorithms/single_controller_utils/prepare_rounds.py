"""One prepare round across the Gym replicas, as a small state machine per replica.

``GymCheckpointCoordinator`` asks every replica to prepare at once, then, each tick, moves each
replica through these states (docs/design.md §5.8, "Snapshots: a replica that cannot be parked
leaves the snapshot"):

    ASKED   --probe sent-------------------------> PROBING --every server answered--> ASKED
    ASKED / PROBING --prepare answered-----------> PARKED | NOT_READY | FAILED
    ASKED / PROBING --a server did not answer----> LEFT_OUT   (a silent probe, an unanswered prepare)
    PROBING --only busy servers were silent--------> ASKED      (at most ``MAX_BUSY_PROBES`` times)
    ASKED / PROBING --past the grace, no probe---> LEFT_OUT   (a straggler)
    ASKED / PROBING --past the hard stop---------> FAILED     (TimeoutError)

The round owns every call it starts (each replica's prepare and its probes): ``close`` cancels what
is still running, awaits all of it and reads each outcome nobody read yet, so no error is dropped.
It knows of Ray only a lost actor (which leaves when the in-run recovery replaces lost replicas) and
nothing of what leaving means for the run; the coordinator acts on the replicas a transition returns.
``PersistStragglers`` applies the same rules to a staged snapshot's persist.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable

import ray

from gym_patches.checkpoint.coordination import CoordinationError, CoordinationFailures, PrepareResult
from nemo_rl.environments.gym_checkpoint_adapter import GymServerProbe

logger = logging.getLogger(__name__)

_UNANSWERED_CODES = ("timeout", "unreachable", "server_dead")
# Probes in a row a replica may stay in a round while its only silent servers are busy (their process
# computing, not stuck): each takes at least the park grace, so a busy server gets several seconds.
MAX_BUSY_PROBES = 4


def unwrap(exc: BaseException) -> BaseException:
    """The error a replica raised, without Ray's task-error wrapper."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def unanswered(exc: BaseException, lost_actor_leaves: bool = False) -> bool:
    """A server that did not answer (or is gone), as opposed to one that answered with an error; with
    ``lost_actor_leaves`` (the in-run recovery replaces lost replicas) a replica whose actor is gone too."""
    if lost_actor_leaves and isinstance(exc, ray.exceptions.RayActorError):
        return True
    if isinstance(exc, CoordinationFailures):
        return all(unanswered(e) for e in exc.failures.values())
    return isinstance(exc, CoordinationError) and exc.code in _UNANSWERED_CODES


def finished_error(future: asyncio.Future) -> BaseException | None:
    """The error a finished call ended with; ``None`` if it returned or was cancelled (by its owner)."""
    if future.cancelled():
        return None
    return future.exception()


def silent_reason(iid: str, silent: dict[str, GymServerProbe]) -> str:
    return "; ".join(f"Gym server {name!r} on {iid} did not answer ({probe.detail})"
                     for name, probe in sorted(silent.items()))


def straggler_reason(iid: str, grace_s: float, probes: dict[str, GymServerProbe] | None) -> str:
    why = f"{iid} was not prepared within {grace_s:g}s after the other replicas"
    blocking = {name: p for name, p in (probes or {}).items() if p.answered and p.blocker_count}
    if blocking:
        why += "; blocking: " + "; ".join(
            f"Gym server {name!r} ({p.blocker_count} rollouts: {', '.join(p.blockers or [])})"
            for name, p in sorted(blocking.items()))
    return why


class ReplicaState(enum.Enum):
    ASKED = "asked"  # its prepare is under way, no probe is
    PROBING = "probing"  # its prepare is under way, and a status probe of its servers
    PARKED = "parked"  # its prepare answered: every server is prepared
    NOT_READY = "not_ready"  # its prepare answered: some server is not (``result.blockers``)
    LEFT_OUT = "left_out"  # it leaves this snapshot (``why_left``); the coordinator resumes it
    FAILED = "failed"  # its prepare failed in a way that fails the attempt (``error``)


_WAITING = (ReplicaState.ASKED, ReplicaState.PROBING)


@dataclass
class ReplicaPrepare:
    """One replica in one round: its prepare call, its probes, and what became of it."""

    iid: str
    call: Any  # what the coordinator sent (a Ray object ref): it cancels the call there when the replica leaves
    prepare: asyncio.Future
    state: ReplicaState = ReplicaState.ASKED
    probe: asyncio.Future | None = None  # the status probe under way, or finished and not read yet
    probed_at: float = float("-inf")
    last_probe: dict[str, GymServerProbe] | None = None  # server -> its latest answer: names what blocks
    result: PrepareResult | None = None
    error: BaseException | None = None
    why_left: str | None = None
    answer_read: bool = False  # ``prepare_answered`` read the prepare's outcome; else ``close`` does
    busy_probes: int = 0  # probes in a row whose only silent servers were busy
    lost_actor_leaves: bool = False  # a lost actor leaves (the in-run recovery replaces it) instead of failing

    @property
    def waiting(self) -> bool:
        return self.state in _WAITING

    def prepare_answered(self) -> bool:
        """Read the finished prepare. A server that did not answer it takes the replica out of this
        snapshot (True) like a silent probe would; any other error (a bad reply, a conflict) is a bug
        that fails the attempt."""
        self.answer_read = True
        exc = self.prepare.exception()
        if exc is None:
            self.result = self.prepare.result()
            self.state = ReplicaState.PARKED if self.result.prepared else ReplicaState.NOT_READY
            return False
        exc = unwrap(exc)
        if unanswered(exc, self.lost_actor_leaves):
            self.leave(f"{self.iid}: {_first_line(exc)}")
            return True
        self.state, self.error = ReplicaState.FAILED, exc
        return False

    def probe_sent(self, call: Awaitable[Any], now: float) -> None:
        """A replica slow to prepare has its servers asked for their status, to tell a hung one
        (which leaves at once) from a busy one, and to name what holds it."""
        self.probe = asyncio.ensure_future(call)
        self.probed_at = now
        self.state = ReplicaState.PROBING

    def probe_answered(self) -> bool:
        """Read the finished probe; if a server did not answer it while the replica still waits, the
        replica leaves (True): waiting on for a hung server would hold every other replica. A server
        that was silent but busy (its process computing) is waited on for up to ``MAX_BUSY_PROBES``
        probes in a row. A probe
        that itself failed says nothing the prepare call will not (it reports what is wrong with the
        actor), so it is logged and the replica is probed again later."""
        probe, self.probe = self.probe, None
        if self.state is ReplicaState.PROBING:
            self.state = ReplicaState.ASKED
        if not self.waiting:
            self.last_probe = None if probe.cancelled() or finished_error(probe) else probe.result()
            return False
        why, self.busy_probes = probe_verdict(self.iid, probe, self.busy_probes)
        if probe.done() and not probe.cancelled() and finished_error(probe) is None:
            self.last_probe = probe.result()
        if why is None:
            return False
        self.leave(why)
        return True

    def leave(self, why: str) -> None:
        """Out of this snapshot: its prepare stops here (the coordinator stops it in the actor and
        resumes the replica); its rollouts are not saved in this snapshot."""
        self.state, self.why_left = ReplicaState.LEFT_OUT, why
        self.prepare.cancel()

    def time_out(self, elapsed_s: float) -> None:
        """Past the hard stop (the deadline plus the reply grace) an unanswered prepare fails the
        attempt: nothing decided to leave it out, so nothing may be saved without it."""
        self.state = ReplicaState.FAILED
        self.error = TimeoutError(f"prepare on {self.iid} did not answer within {elapsed_s:.1f}s")
        self.prepare.cancel()


def probe_verdict(iid: str, probe: asyncio.Future, busy_probes: int) -> tuple[str | None, int]:
    """Read a finished status probe of a replica still waiting: why it leaves (a server that did not
    answer; one silent but busy, its process computing, is waited on for up to ``MAX_BUSY_PROBES`` probes
    in a row), or None, with the new count of busy probes in a row. A probe that itself failed says
    nothing the call it watches will not (it reports what is wrong with the actor): logged, not a verdict."""
    exc = finished_error(probe)
    if probe.cancelled() or exc is not None:
        logger.info("status probe of %s failed (its call reports the actor's error): %s", iid, exc or "cancelled")
        return None, busy_probes
    silent = {name: p for name, p in probe.result().items() if not p.answered}
    if not silent:
        return None, 0
    if all(p.busy for p in silent.values()) and busy_probes < MAX_BUSY_PROBES:
        logger.info("status probe %d of %s: %s; waiting on", busy_probes + 1, iid, silent_reason(iid, silent))
        return None, busy_probes + 1  # busy, not hung: thousands of rollouts (docs/design.md §5.8)
    return silent_reason(iid, silent), busy_probes


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


@dataclass(frozen=True)
class RoundClock:
    """When things happen in a round, in ``time.monotonic()`` seconds."""

    started: float
    hard_stop: float  # a replica still waiting then fails the attempt
    park_grace_s: float  # how long stragglers get once every other replica is prepared
    probe_after_s: float  # a replica still waiting this long is probed ...
    probe_every_s: float  # ... this often


@dataclass
class PrepareRound:
    """Every asked replica of one prepare, driven tick by tick by the coordinator."""

    checkpoint_id: str
    replicas: dict[str, ReplicaPrepare]
    clock: RoundClock
    others_prepared_at: float | None = None  # when the grace began

    @classmethod
    def start(cls, checkpoint_id: str, calls: dict[str, Awaitable[Any]], clock: RoundClock,
              lost_actor_leaves: bool = False) -> "PrepareRound":
        """Own each replica's prepare call from here on."""
        replicas = {iid: ReplicaPrepare(iid, call, asyncio.ensure_future(call), lost_actor_leaves=lost_actor_leaves)
                    for iid, call in calls.items()}
        return cls(checkpoint_id, replicas, clock)

    def abandon(self, taken: dict[str, str]) -> list[ReplicaPrepare]:
        """Waiting replicas the in-run recovery took over (-> why) leave now (docs/design.md §5.12)."""
        leaving = [r for r in self.waiting() if r.iid in taken]
        for replica in leaving:
            replica.leave(taken[replica.iid])
        return leaving

    def waiting(self) -> list[ReplicaPrepare]:
        return [r for r in self.replicas.values() if r.waiting]

    async def next_event(self, tick_s: float) -> None:
        """Until some prepare or probe finishes, or ``tick_s`` passes."""
        watched = [r.prepare for r in self.waiting()] + [r.probe for r in self.replicas.values() if r.probe]
        await asyncio.wait(watched, timeout=tick_s, return_when=asyncio.FIRST_COMPLETED)

    def read_answers(self) -> list[ReplicaPrepare]:
        """Every prepare, then every probe, that finished; returns the replicas that left for it."""
        left = [r for r in self.waiting() if r.prepare.done() and r.prepare_answered()]
        left += [r for r in self.replicas.values() if r.probe and r.probe.done() and r.probe_answered()]
        return left

    def others_prepared(self) -> bool:
        """Some replica parked and none is not ready or failed: only the waiting ones are missing."""
        states = [r.state for r in self.replicas.values()]
        return (ReplicaState.PARKED in states and ReplicaState.NOT_READY not in states
                and ReplicaState.FAILED not in states)

    def start_grace(self, now: float) -> None:
        """The first time every other replica is prepared, the stragglers' grace starts; each is
        probed at once (not after its probe period) so the reason it may leave for names a server."""
        if self.others_prepared_at is None and self.others_prepared():
            self.others_prepared_at = now
            for replica in self.replicas.values():
                replica.probed_at = float("-inf")

    def due_for_probe(self, now: float) -> list[ReplicaPrepare]:
        """Waiting replicas with no probe under way, slow for ``probe_after_s`` (or the last ones
        missing) and not probed within ``probe_every_s``."""
        slow = self.others_prepared() or now - self.clock.started >= self.clock.probe_after_s
        return [r for r in self.waiting()
                if r.state is ReplicaState.ASKED and slow and now - r.probed_at >= self.clock.probe_every_s]

    def stragglers(self, now: float) -> list[ReplicaPrepare]:
        """Replicas still waiting ``park_grace_s`` after every other one was prepared leave; one with
        a probe under way is given until it answers (so the reason names its server), unless the
        probe is late itself (twice the grace and a second: its own timeout is the grace)."""
        if not self.others_prepared() or self.others_prepared_at is None:
            return []
        waited = now - self.others_prepared_at
        if waited < self.clock.park_grace_s:
            return []
        late = waited >= 2 * self.clock.park_grace_s + 1.0
        leaving = [r for r in self.waiting() if r.state is ReplicaState.ASKED or late]
        for replica in leaving:
            replica.leave(straggler_reason(replica.iid, self.clock.park_grace_s, replica.last_probe))
        return leaving

    def stop_the_late(self, now: float) -> None:
        """Past the hard stop every replica still waiting fails (``ReplicaPrepare.time_out``)."""
        if now >= self.clock.hard_stop:
            for replica in self.waiting():
                replica.time_out(now - self.clock.started)

    def results(self) -> dict[str, PrepareResult]:
        """What each replica that answered its prepare said (parked or not ready)."""
        return {r.iid: r.result for r in self.replicas.values() if r.result is not None}

    def failures(self) -> dict[str, BaseException]:
        return {r.iid: r.error for r in self.replicas.values() if r.state is ReplicaState.FAILED}

    async def close(self) -> None:
        """Cancel every call still running, await them all, and read each outcome not read yet (the
        prepare of a replica that left or timed out, probes nobody waited for): logged, not dropped.
        States do not change here: a round closed early (cancelled) decides nothing more."""
        calls = [r.prepare for r in self.replicas.values()] + [r.probe for r in self.replicas.values() if r.probe]
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        for replica in self.replicas.values():
            unread = [("prepare", replica.prepare)] if not replica.answer_read else []
            unread += [("status probe", replica.probe)] if replica.probe is not None else []
            replica.probe = None
            for what, call in unread:
                exc = finished_error(call)
                if exc is not None:
                    logger.info("snapshot %s: the %s of %s (%s) ended with: %s", self.checkpoint_id, what,
                                replica.iid, replica.state.value, unwrap(exc))


class PersistStragglers:
    """The replicas of one staged snapshot's persist (after resume): each writes its records; one the
    in-run recovery takes over or whose actor is lost leaves at once, and once every other replica has
    written, one whose server stays silent to a status probe past the park grace leaves too (a stopped
    or hung server; a busy one gets ``MAX_BUSY_PROBES`` probes), so no replica holds the snapshot for
    the call timeout (docs/design.md §5.8). Owns every call it starts; ``close`` awaits them all."""

    def __init__(self, calls: dict[str, Awaitable[Any]], park_grace_s: float, timeout_s: float,
                 lost_actor_leaves: bool = False):
        self.calls = {iid: asyncio.ensure_future(call) for iid, call in calls.items()}
        self.park_grace_s = park_grace_s
        self.hard_stop = time.monotonic() + max(0.1, timeout_s)
        self.lost_actor_leaves = lost_actor_leaves
        self.left_out: dict[str, str] = {}
        self.probes: dict[str, asyncio.Future] = {}
        self.probed_at: dict[str, float] = {}
        self.busy_probes: dict[str, int] = {}
        self.others_done_at: float | None = None
        self.timed_out: set[str] = set()

    def waiting(self) -> list[str]:
        """Replicas whose persist has not answered and that have not left, until the hard stop."""
        waiting = [iid for iid, call in self.calls.items() if not call.done() and iid not in self.left_out]
        if waiting and time.monotonic() >= self.hard_stop:
            self.timed_out.update(waiting)
            for iid in waiting:
                self.calls[iid].cancel()
            return []
        return waiting

    async def next_event(self, tick_s: float) -> None:
        watched = [self.calls[iid] for iid in self.waiting()] + list(self.probes.values())
        if watched:
            await asyncio.wait(watched, timeout=tick_s, return_when=asyncio.FIRST_COMPLETED)
        for iid, probe in list(self.probes.items()):
            if probe.done():
                del self.probes[iid]
                if iid in self.waiting():
                    why, self.busy_probes[iid] = probe_verdict(iid, probe, self.busy_probes.get(iid, 0))
                    if why is not None:
                        self._leave(iid, why)
        for iid, call in self.calls.items():  # an answered persist from a lost actor: it leaves
            if call.done() and iid not in self.left_out and not call.cancelled() and call.exception() is not None:
                exc = unwrap(call.exception())
                if unanswered(exc, self.lost_actor_leaves):
                    self.left_out[iid] = f"{iid}: {_first_line(exc)}"

    def abandon(self, taken: dict[str, str]) -> None:
        for iid in self.waiting():
            if iid in taken:
                self._leave(iid, taken[iid])

    def due_for_probe(self, now: float, every_s: float) -> list[str]:
        """Replicas still writing ``park_grace_s`` after every other one has written, not probed lately."""
        waiting = self.waiting()
        if not waiting or not self._others_done(waiting):
            return []
        if self.others_done_at is None:
            self.others_done_at = now
        if now - self.others_done_at < self.park_grace_s:
            return []
        return [iid for iid in waiting
                if iid not in self.probes and now - self.probed_at.get(iid, float("-inf")) >= every_s]

    def _others_done(self, waiting: list[str]) -> bool:
        return all(self.calls[iid].done() or iid in self.left_out for iid in self.calls if iid not in waiting)

    def probe_sent(self, iid: str, call: Awaitable[Any]) -> None:
        self.probes[iid] = asyncio.ensure_future(call)
        self.probed_at[iid] = time.monotonic()

    def _leave(self, iid: str, why: str) -> None:
        self.left_out[iid] = why
        self.calls[iid].cancel()

    def results(self) -> dict[str, Any]:
        return {iid: call.result() for iid, call in self.calls.items()
                if iid not in self.left_out and call.done() and not call.cancelled() and call.exception() is None}

    def failures(self) -> dict[str, BaseException]:
        out: dict[str, BaseException] = {}
        for iid, call in self.calls.items():
            if iid in self.left_out:
                continue
            if iid in self.timed_out:
                out[iid] = TimeoutError(f"persist on {iid} did not answer in time")
            elif call.done() and not call.cancelled() and call.exception() is not None:
                out[iid] = unwrap(call.exception())
        return out

    async def close(self) -> None:
        """Cancel what still runs (the left-out replicas' calls, probes) and await all of it."""
        pending = [c for c in [*self.calls.values(), *self.probes.values()] if not c.done()]
        for call in pending:
            call.cancel()
        await asyncio.gather(*self.calls.values(), *self.probes.values(), return_exceptions=True)
