"""In-run recovery of Gym replicas (docs/design.md §5.12): a lost server or replica is a recovery, not a
failure of its rollouts, and the run goes on.

Supervision: one watch per replica (``NemoGym.watch``: a server exited, or stayed stopped or silent
for ``rollout_recovery.in_run.hung_after_s``), and the replica's actor itself (a watch that ends in
``RayActorError``). A rollout whose ``/run`` failed because its replica lost a server or its actor
reports it too (``report``). Losses are recovered one at a time, in the order noticed:

1. the replica takes no new rollout; its rollout tasks are cancelled and awaited (the recovery owns
   their attempts now), under the snapshotter's ``busy``, so no snapshot or prune runs meanwhile;
2. its actor is stopped (every server with it) and a new one started in its slot (``restarted``: a
   server died; ``replaced``: the actor was lost). If Ray cannot place it, or the replica was lost more
   than ``max_recoveries`` times in ``window_s``, it is given up and its rollouts move to the shard's
   other replicas (``moved``); with none left the run stops, naming the server, the replica and its log;
3. each rollout that was there continues at its next attempt from the newest committed snapshot that
   holds it at its current attempt (Gym installs the saved episodes, as a relaunch would); the others
   restart from their prompt (no failure counted);
4. a line on stderr, a row in ``recoveries.jsonl``, and a snapshot is asked for, so the continued
   rollouts are saved again at their new attempt.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

import ray

from gym_patches.checkpoint.identity import EpisodeId
from nemo_rl.algorithms.single_controller_utils.config import InRunRecoveryConfig
from nemo_rl.algorithms.single_controller_utils.gym_coordinator import GymCheckpointCoordinator
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.reshard import plan_restore
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.store import RunStore
from nemo_rl.algorithms.single_controller_utils.run_records import RunRecords
from nemo_rl.environments.nemo_gym import NemoGymShardSet, ReplicaNotPlaced
from nemo_rl.experience.rollout_recovery import RolloutRecoveryLedger
from nemo_rl.experience.rollout_recovery.restart import RestoredEpisode
from nemo_rl.utils.atomic_write import write_json_atomic

logger = logging.getLogger(__name__)
REDISPATCH_WAIT_S = 60.0  # how long the row waits for the first continued rollout to be sent again


class GymRecoveryFailed(RuntimeError):
    """A replica could not be recovered and its shard has no other: the run stops (one ``error:`` line)."""


@dataclass
class Loss:
    """One lost part of one replica, as noticed."""

    instance: str
    part: str  # the server's name, or "replica" (the actor itself)
    cause: str
    handle: Any  # the actor it was noticed on: a later report about an older actor is stale
    noticed: float = field(default_factory=time.monotonic)
    at: float = field(default_factory=time.time)
    log: str | None = None
    log_tail: str = ""
    reported: bool = False  # by a failed rollout (the watch says more: the exit code and the log)


@dataclass
class _Redispatch:
    """When the first rollout a recovery continued went to Gym again (``GymReplicaRecovery.dispatched``)."""

    keys: set[str]
    first: float | None = None
    sent: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class _Restored:
    """What Gym installed for a recovery: the ledger's triples and the row's lists."""

    snapshot: str | None = None
    episodes: set[RestoredEpisode] = field(default_factory=set)
    relocated: dict[str, str] = field(default_factory=dict)  # base rollout id -> replica it moved to
    saved_keys: set[str] = field(default_factory=set)  # lost attempts' capture keys Gym installed again
    prefix: set[str] = field(default_factory=set)  # of those, the ones whose model call continues from a cut


class GymReplicaRecovery:
    """Owns every replica's watch and the recoveries; ``run`` is a task of the controller's group."""

    def __init__(
        self,
        settings: InRunRecoveryConfig,
        shard_set: NemoGymShardSet,
        coordinator: GymCheckpointCoordinator | None,
        store: RunStore,
        records: RunRecords,
        *,
        ledger: Callable[[], RolloutRecoveryLedger],
        stop_rollouts: Callable[[str], Awaitable[None]],  # cancel and await the rollout tasks on a replica
        notify: Callable[[], Awaitable[None]],  # the ledger changed: wake the dispatcher
        request_snapshot: Callable[[str], None],
        busy: asyncio.Lock | None,  # the snapshotter's: no snapshot or prune during a recovery
    ):
        self.settings = settings
        self.shard_set = shard_set
        self.coordinator = coordinator
        self.store = store
        self.records = records
        self.ledger = ledger
        self.stop_rollouts = stop_rollouts
        self.notify = notify
        self.request_snapshot = request_snapshot
        self.busy = busy
        self.count = 0
        self._queue: asyncio.Queue[Loss] = asyncio.Queue()
        self._pending: set[str] = set()  # replicas with a loss queued or being recovered
        self._idle = asyncio.Event()
        self._idle.set()
        self._history: dict[str, collections.deque[float]] = {}  # replica -> when it was recovered
        self._holding: dict[str, str] = {}  # replica -> newest committed snapshot that saved rollouts there
        self._awaiting: list[_Redispatch] = []  # recoveries whose row waits for their first redispatch
        self._watches: dict[str, asyncio.Task] = {}
        self._start_s: float | None = None  # the last new replica's start, actor to servers up
        self._details: dict[str, Loss] = {}  # replica -> what its watch saw of a loss a rollout reported first

    # -- what the controller tells it
    def snapshot_committed(self, path: str, saved_on: list[str]) -> None:
        """A snapshot was published holding rollouts of ``saved_on``: the newest to restore them from."""
        for iid in saved_on:
            self._holding[iid] = path

    def holding(self) -> frozenset[Path]:
        """The snapshots a recovery would restore from now (one per replica, at most): a publish keeps them
        beyond ``keep_latest_k`` while newer snapshots left their replica out (a hung server)."""
        return frozenset(Path(p) for p in self._holding.values())

    def report(self, instance: str, handle: Any, part: str, cause: str) -> None:
        """A rollout's ``/run`` failed because ``instance`` lost ``part``: recover it (once)."""
        if handle is not self._current(instance) or instance in self._pending:
            return
        self._enqueue(Loss(instance, part, cause, handle, reported=True))

    def dispatched(self, rollout_id: str) -> None:
        """The controller sent ``rollout_id`` to Gym: the first continued one ends the row's wait."""
        for waiting in self._awaiting:
            if waiting.first is None and rollout_id in waiting.keys:
                waiting.first = time.monotonic()
                waiting.sent.set()

    def owns(self, instance: str) -> bool:
        """A recovery of ``instance`` is queued or running: its rollouts' failures are the recovery's."""
        return instance in self._pending

    @property
    def busy_now(self) -> bool:
        """A loss is queued or being recovered."""
        return bool(self._pending)

    async def wait_idle(self) -> None:
        """Until no recovery is queued or running (a snapshot waits for it: §5.12)."""
        await self._idle.wait()

    # -- the task
    async def run(self) -> None:
        """Watch every replica and recover what is lost, one at a time, until cancelled."""
        try:
            for iid in self.shard_set.checkpoint_handles:
                self._watch(iid)
            async with asyncio.TaskGroup() as rows:  # each recovery's row, written once its rollouts went out
                while True:
                    loss = await self._queue.get()
                    done = await self._recover(loss)  # an error stops the run: nothing waiting is let go
                    self._pending.discard(loss.instance)
                    if not self._pending:
                        self._idle.set()
                    if done is not None:
                        rows.create_task(self._report(*done), name=f"gym-recovery-row:{loss.instance}")
        finally:
            for task in self._watches.values():
                task.cancel()
            await asyncio.gather(*self._watches.values(), return_exceptions=True)

    def _current(self, instance: str) -> Any:
        return self.shard_set.checkpoint_handles.get(instance)

    def _enqueue(self, loss: Loss) -> None:
        self._pending.add(loss.instance)
        self.shard_set.recovering.add(loss.instance)  # no new rollout goes there from now on
        self._idle.clear()
        self._queue.put_nowait(loss)

    def _watch(self, instance: str) -> None:
        handle = self._current(instance)
        old = self._watches.get(instance)
        if old is not None:
            old.cancel()
        self._watches[instance] = asyncio.create_task(self._watch_one(instance, handle), name=f"gym-watch:{instance}")

    async def _watch_one(self, instance: str, handle: Any) -> None:
        try:
            lost = await handle.watch.remote(self.settings.hung_after_s)
        except ray.exceptions.RayActorError as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            loss = Loss(instance, "replica", f"its Ray actor died ({first[:200]})", handle)
        else:
            loss = Loss(instance, lost["server"], lost["cause"], handle, log=lost["log"], log_tail=lost["log_tail"])
        if handle is not self._current(instance):
            return
        if instance in self._pending:
            self._details[instance] = loss
        else:
            self._enqueue(loss)

    # -- one recovery
    async def _recover(self, loss: Loss) -> tuple | None:
        """The sequence of docs/design.md §5.12 for one loss; what its row needs, or None (a stale loss)."""
        iid = loss.instance
        if loss.handle is not self._current(iid):
            self.shard_set.recovering.discard(iid)
            return None  # noticed on an actor already replaced
        loss = await self._with_details(loss)
        self._start_s = None
        give_up = self._too_often(iid)
        logger.warning("Gym %s lost %s: %s; recovering", iid, loss.part, loss.cause)
        async with self.busy if self.busy is not None else contextlib.nullcontext():
            await self.stop_rollouts(iid)
            affected = self.ledger().live_on(iid)
            action, why = ("moved", give_up) if give_up is not None else await self._start_again(loss)
            if action == "moved":
                self._give_up(loss, why)
            write_json_atomic(self.records.log_dir / "gym_placement.json", self.shard_set.placement)
            if self.coordinator is not None:
                self.coordinator.forget_instance(iid)
            restored = await self._restore(iid, affected, moved=action == "moved")
            summary = self.ledger().recover_rollouts(affected, restored.episodes, restored.relocated)
            self.shard_set.recovering.discard(iid)
            self._history.setdefault(iid, collections.deque()).append(time.monotonic())
            if action != "moved":
                self._watch(iid)
            waiting = _Redispatch(set(summary.restored_turn + summary.restarted_from_prompt))
            self._awaiting.append(waiting)
        self.count += 1
        await self.notify()
        return loss, action, why, affected, restored, summary, waiting, self._start_s

    async def _report(self, loss: Loss, action: str, why: str | None, affected: list[str], restored: "_Restored",
                      summary: Any, waiting: _Redispatch, start_s: float | None) -> None:
        """The recovery's row and line, once its first rollout went to Gym again (or after a bound), and a
        snapshot asked for, so the continued rollouts are saved again at their new attempt."""
        iid = loss.instance
        seconds = await self._seconds_to_redispatch(loss, waiting)
        row = {
            "time": loss.at, "instance": iid, "part": loss.part, "cause": loss.cause, "action": action,
            "snapshot": restored.snapshot,
            # the lost attempts, by their capture keys (as gym_checkpoint.json names the saved ones)
            "continued_turn": sorted(restored.saved_keys - restored.prefix),
            "continued_prefix": sorted(restored.prefix),
            "restarted_from_prompt": sorted(set(affected) - restored.saved_keys),
            "kept_siblings": len(summary.kept_siblings),
            "seconds_to_redispatch": seconds,
            "seconds_to_start": start_s,  # of that, the new replica's start (actor, servers, control)
            **({"given_up": why} if action == "moved" else {}),
        }
        self.records.recovery(row)
        self._say(loss, row)
        self.request_snapshot(f"recovery of {iid}")

    async def _start_again(self, loss: Loss) -> tuple[str, str | None]:
        """A new actor in the replica's slot: ``restarted`` (a server was lost) or ``replaced`` (the actor).
        A start that fails (a server dies while starting) counts as one more recovery and is tried again
        until the bound; one Ray cannot place gives the replica up at once (``moved``, and why)."""
        iid = loss.instance
        while True:
            started = time.monotonic()
            try:
                async with asyncio.timeout(self.settings.timeout_s):
                    await self.shard_set.start_replacement(iid, self.settings.placement_timeout_s)
                self._start_s = round(time.monotonic() - started, 3)
                return ("restarted" if loss.part != "replica" else "replaced"), None
            except ReplicaNotPlaced as exc:
                return "moved", str(exc)
            except (TimeoutError, ray.exceptions.RayError) as exc:
                failed = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
                logger.warning("Gym %s did not start again (%s)", iid, failed)
                self._history.setdefault(iid, collections.deque()).append(time.monotonic())
                too_often = self._too_often(iid)
                if too_often is not None:
                    return "moved", f"{too_often}; its last start failed: {failed}"

    async def _with_details(self, loss: Loss, wait_s: float = 2.0) -> Loss:
        """A loss a rollout reported, with what the replica's watch says of it (the server, its exit code
        and log), which comes a moment later; the time noticed stays the earlier one."""
        watch = self._watches.get(loss.instance)
        if loss.reported and watch is not None:
            await asyncio.wait({watch}, timeout=wait_s)
        seen = self._details.pop(loss.instance, None)
        if seen is None or seen.handle is not loss.handle:
            return loss
        seen.noticed, seen.at = loss.noticed, loss.at
        return seen

    def _too_often(self, iid: str) -> str | None:
        """Why the replica is given up now (recovered ``max_recoveries`` times within ``window_s``), or None."""
        history = self._history.setdefault(iid, collections.deque())
        while history and time.monotonic() - history[0] > self.settings.window_s:
            history.popleft()
        if len(history) >= self.settings.max_recoveries:
            return (f"recovered {len(history)} times within {self.settings.window_s:g} s "
                    f"(rollout_recovery.in_run.max_recoveries={self.settings.max_recoveries})")
        return None

    def _give_up(self, loss: Loss, why: str | None) -> None:
        """Drop the replica; with no other replica of its shard the run stops, naming the server and its log."""
        iid = loss.instance
        survivors = self.shard_set.survivors(iid)
        if not survivors:
            where = f"; its log {loss.log}, last lines:\n{loss.log_tail}" if loss.log else ""
            raise GymRecoveryFailed(
                f"Gym server {loss.part!r} of {iid} was lost ({loss.cause}) and the replica is given up: {why}; "
                f"shard {self.shard_set.shard_of(iid)!r} has no other replica, so the run stops{where}")
        logger.warning("Gym %s is given up (%s); its rollouts move to %s", iid, why, ", ".join(survivors))
        self.shard_set.drop(iid)
        task = self._watches.pop(iid, None)
        if task is not None:
            task.cancel()

    async def _restore(self, iid: str, affected: list[str], *, moved: bool) -> _Restored:
        """Gym installs the episodes of ``affected`` that the newest snapshot holding ``iid``'s rollouts
        saved at their current attempt: on the new replica, or dealt over the survivors (``moved``)."""
        done = _Restored()
        path = self._holding.get(iid)
        if self.coordinator is None or path is None or not affected:
            return done
        try:
            index = await asyncio.to_thread(self.store.read_gym_index, Path(path))
        except Exception as exc:  # noqa: BLE001 - pruned or unreadable: they restart from the prompt
            logger.warning("recovery of %s cannot read snapshot %s (%s); its rollouts restart from the prompt",
                           iid, path, exc)
            return done
        wanted = set(affected)
        saved = {server: [k for k in keys if k in wanted] for server, keys in index.exported().get(iid, {}).items()}
        if not any(saved.values()):
            return done
        try:
            running = [r for r in self.coordinator.instance_ids if not moved or r != iid]
            unportable = (await self.coordinator.unportable_servers([self.shard_set.shard_of(iid)])) if moved else None
            plan = plan_restore({iid: saved}, running, unportable)
            new_keys = await self.coordinator.restore(f"recover-{uuid.uuid4().hex[:12]}", path, plan.sources,
                                                      index.checkpoint_id)
        except Exception as exc:  # noqa: BLE001 - Gym could not install them: they restart from the prompt
            logger.warning("recovery of %s could not restore from %s (%s: %s); its rollouts restart from the "
                           "prompt", iid, path, type(exc).__name__, exc)
            return done
        done.snapshot = path
        for target, keys in new_keys.items():
            for key in keys:
                episode = EpisodeId.from_capture_key(key)
                done.episodes.add((iid, episode.rollout_id, episode.attempt))
                if target != iid:
                    done.relocated[episode.rollout_id] = target
                saved_key = EpisodeId(rollout_id=episode.rollout_id, attempt=episode.attempt - 1).capture_key
                done.saved_keys.add(saved_key)
                if index.cut_of(iid, saved_key):
                    done.prefix.add(saved_key)
        return done

    async def _seconds_to_redispatch(self, loss: Loss, waiting: _Redispatch) -> float | None:
        """Seconds from the loss being noticed to the first continued rollout sent to Gym again (None: none,
        or not within ``REDISPATCH_WAIT_S``)."""
        try:
            if waiting.keys:
                await asyncio.wait_for(waiting.sent.wait(), REDISPATCH_WAIT_S)
        except TimeoutError:
            pass
        finally:
            self._awaiting.remove(waiting)
        return None if waiting.first is None else round(waiting.first - loss.noticed, 3)

    def _say(self, loss: Loss, row: dict[str, Any]) -> None:
        """One line on stderr per recovery."""
        verb = {"restarted": "restarted", "replaced": "replaced", "moved": "moved to the shard's other replicas"}
        took = f" in {row['seconds_to_redispatch']:.1f} s" if row["seconds_to_redispatch"] is not None else ""
        what = f"{loss.part} {loss.cause}" if loss.part != "replica" else loss.cause
        print(f"recovered {loss.instance}: {what}; {verb[row['action']]}{took}; "
              f"{len(row['continued_turn'])} rollouts continue at their turn, "
              f"{len(row['continued_prefix'])} from a generation cut, "
              f"{len(row['restarted_from_prompt'])} restart from the prompt", file=sys.stderr, flush=True)
