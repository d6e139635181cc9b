"""The participant interface every checkpointing Gym server implements.

The control plane (the ``control`` package) owns phases, the lease, auth and storage;
a participant only knows how to close, report readiness, export and install.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import Any, Awaitable, Callable, ClassVar, Collection

from gym_patches.checkpoint.cuts import CutSummary
from gym_patches.checkpoint.errors import CheckpointError, StaleAttemptError
from gym_patches.checkpoint.identity import EpisodeId
from gym_patches.checkpoint.wire import ParticipantKind, PrepareReport, RestartOnlyPolicy

Record = dict[str, Any]  # JSON object with at least "episode_id": {rollout_id, attempt}


class CheckpointParticipant(ABC):
    """One per server process. Subclasses call ``notify_changed()`` whenever
    anything that ``readiness()`` reads changes, so prepare wakes at once."""

    kind: ClassVar[ParticipantKind]
    # Whether a record this server saved can be installed by the same server on another replica of
    # its shard (docs/design.md §5.7, portable records): it names the episode, never this process (no port,
    # pid, local path or in-process handle). A server whose records are not portable sets False and
    # says so in its status; its episodes then continue only on the replica that saved them.
    records_portable: bool = True

    def __init__(self) -> None:
        self.accepting: bool = True
        # Set by the first close_admission of a participant that serialises sessions as they come to
        # rest: from then on it does so while open too, so a snapshot's capture finds the work done.
        # Off until the server takes part in checkpoints, so runs without snapshots never pay for it.
        self.capture_eagerly: bool = False
        self.policy: RestartOnlyPolicy = "block"
        # rollout_id -> highest retired attempt; attempts at or below are refused.
        self.retired: dict[str, int] = {}
        self._version = 0
        self._changed: asyncio.Event | None = None

    # -- admission ---------------------------------------------------------
    @abstractmethod
    async def close_admission(self, policy: RestartOnlyPolicy) -> None:
        """Stop new work per the participant's rules; remember ``policy``."""

    @abstractmethod
    async def open_admission(self) -> None:
        """Undo ``close_admission``: release anything held, let waiters in."""

    @abstractmethod
    def readiness(self) -> PrepareReport:
        """Blockers (capture keys that prevent a consistent snapshot) and unsaved keys."""

    def is_ready(self) -> bool:
        """``readiness().ready``, cheaply: the control plane polls it on every change while
        preparing (hundreds of times at thousands of sessions) and builds the report once ready.
        An override must agree with ``readiness``."""
        return self.readiness().ready

    def ended_runs(self) -> list[str] | None:
        """Capture keys of the ``/run`` calls this server answered lately (an agent's, reported once
        prepared: ``PrepareReport.ended``); None: it does not keep them."""
        return None

    # -- lifecycle ---------------------------------------------------------
    @abstractmethod
    async def export(self, episodes: list[EpisodeId] | None) -> list[Record]:
        """Records of the given episodes (None = all exportable). Only called
        while prepared; must not include unsaved episodes."""

    @abstractmethod
    async def install(self, records: list[Record], replay: Collection[str] = ()) -> list[str]:
        """Install records under ``next_attempt``; return the new capture keys.
        All or nothing: on error nothing is installed. ``replay``: capture keys of saved episodes
        that start again from their prompt, answered from the model's recorded calls; only a model
        server installs those (``refuse_replay`` for the others). The control plane passes it only
        when not empty."""

    def refuse_replay(self, replay: Collection[str], name: str) -> None:
        """A server that is not a model server is never asked to install a replayed episode: its agent and
        tools run that episode from its prompt, fresh."""
        if replay:
            raise CheckpointError(
                f"{name}: episodes {sorted(replay)[:10]} are restored by replay: only the model server installs "
                f"them (restore them on the model server's scope alone)")

    async def capture_records(self) -> list[Any]:
        """What a staged capture takes, the moment the participant is prepared: ``export(None)``.
        An override may hand over ``records.CapturedRecord``s (``capture_record``) kept per
        session that has not moved, so the capture does no per-record work for those."""
        return await self.export(None)

    def scope_fill(self) -> Callable[[EpisodeId], Record | None] | None:
        """For a staged capture (``capture_records()``, taken the moment the participant is
        prepared): how to make, later, the record of an in-scope episode the capture left out,
        as things stood when prepared. None (the default): such an episode has no record."""
        return None

    def capture_completion(self) -> Callable[[], Awaitable[tuple[dict[str, Record], int, str | None]]] | None:
        """For a staged capture taken now: what, after resume and before ``persist`` writes, adds fields
        to some captured records (capture key -> fields; the model's generation cuts, whose tokens are
        fetched outside the pause), with how many generation cuts it could not complete and why. None
        (the default): the capture is complete as taken."""
        return None

    async def take_cut(self, rollouts: Collection[str] | None = None) -> CutSummary | None:
        """A prepare with ``cut`` asks this as admission closes: the model server saves the tokens of
        its calls in flight of ``rollouts`` (None: of every rollout; ``gym_patches.checkpoint.cuts``).
        Other kinds have nothing to cut."""
        return None

    def cut_summary(self) -> CutSummary | None:
        """What the current prepare's cut took, for its reply (None: no cut)."""
        return None

    async def retire(self, episodes: list[EpisodeId]) -> list[str]:
        """Stop and forget the given attempts; refuse them from now on."""
        for episode in episodes:
            self.mark_retired(episode)
        return [e.capture_key for e in episodes]

    def forget(self, rollout_ids: set[str]) -> int:
        """Drop what is kept about finished rollouts (all their attempts); returns how many entries.

        Subclasses that keep more per rollout extend this. Only the caller knows
        no snapshot can bring these rollouts back (RL calls it once their group's
        trainer step is durable)."""
        gone = [r for r in self.retired if r in rollout_ids]
        for rollout_id in gone:
            del self.retired[rollout_id]
        return len(gone)

    def status_extra(self) -> dict[str, Any]:
        return {}

    async def stop(self) -> None:
        """The server is stopping (the control plane's ``stop``, after its own jobs): cancel and await the
        background work the participant owns (the model's cut pins). Nothing by default."""

    # -- helpers -----------------------------------------------------------
    def mark_retired(self, episode: EpisodeId) -> None:
        prev = self.retired.get(episode.rollout_id, -1)
        self.retired[episode.rollout_id] = max(prev, episode.attempt)
        self.notify_changed()

    def check_attempt(self, episode: EpisodeId) -> None:
        """Raise ``stale_attempt`` for a retired attempt."""
        highest = self.retired.get(episode.rollout_id)
        if highest is not None and episode.attempt <= highest:
            raise StaleAttemptError(
                f"episode {episode.capture_key} was retired (attempts <= {highest} refused)"
            )

    def notify_changed(self) -> None:
        self._version += 1
        if self._changed is not None:
            self._changed.set()

    async def wait_changed(self, timeout: float) -> None:
        """Sleep until ``notify_changed`` or ``timeout`` seconds, whichever first."""
        if self._changed is None:
            self._changed = asyncio.Event()
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout=max(0.0, timeout))
        except asyncio.TimeoutError:
            pass
