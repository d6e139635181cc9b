"""A Gym replica as a supervised part (docs/design.md §5.12).

Its losses come from one stream: the replica's watch (``NemoGym.watch``: a server exited, or stayed stopped
or silent for ``hung_after_s``; a watch ending in ``RayActorError`` is a lost actor; a watch that fails for
any other reason is a loss too, so no replica is ever left unsupervised), a rollout whose ``/run`` failed
because a server of the replica died or its actor was lost, and a snapshot that met the lost actor. The
first notice takes the replica over at once: it takes no new rollout and every snapshot passes it over.

The whole replica starts again, not only the lost server: a rollout's records span its agent, resources
and model servers and are installed from one snapshot together, into idle servers, as at a relaunch. Its
lost rollouts come back through the same install as a relaunch's (``install.install_episodes``) and the
ledger's one entry (``bring_back``), from the newest committed snapshot that saved rollouts of this replica
(held in the run store meanwhile); the rest restart from their prompt. A replica given up (``moved``) has
its saved rollouts dealt over its shard's other replicas by the elastic-restore rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import ray

from nemo_rl.algorithms.single_controller_utils.config import InRunRecoveryConfig
from nemo_rl.algorithms.single_controller_utils.gym_coordinator import GymCheckpointCoordinator
from nemo_rl.algorithms.single_controller_utils.recovery.records import Loss, RecoveryRecord
from nemo_rl.algorithms.single_controller_utils.recovery.supervisor import (
    NotPlaced,
    RecoveryFailed,
    describe,
    took,
)
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.install import (
    InstalledEpisodes,
    SavedIn,
    install_episodes,
    saved_key,
)
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.store import REPLICA_HOLD, RunStore
from nemo_rl.environments.nemo_gym import NemoGymShardSet, ReplicaNotPlaced
from nemo_rl.experience.rollout_recovery import RolloutRecoveryLedger
from nemo_rl.utils.atomic_write import write_json_atomic
from nemo_rl.utils.run_hooks import RunHooks

logger = logging.getLogger(__name__)
REDISPATCH_WAIT_S = 60.0  # how long a row waits for the first continued rollout to be sent to Gym again


class RecoveryHost(Protocol):
    """What a recovery asks of the controller."""

    def ledger(self) -> RolloutRecoveryLedger: ...

    async def stop_rollouts(self, instance: str) -> None: ...  # cancel and await its rollout tasks

    async def notify(self) -> None: ...  # the ledger changed: wake the dispatcher

    def request_snapshot(self, by: str) -> None: ...


@dataclass
class Redispatch:
    """When the first rollout a recovery brought back went to Gym again (controller's monotonic clock)."""

    keys: set[str]
    first: float | None = None
    sent: asyncio.Event = field(default_factory=asyncio.Event)

    def dispatched(self, rollout_id: str) -> None:
        if self.first is None and rollout_id in self.keys:
            self.first = time.monotonic()
            self.sent.set()


class GymReplicaPart:
    """One ``<shard>/replica-<i>``: its watch, its replacement, and its rollouts' return."""

    kind = "gym_replica"

    def __init__(self, instance: str, settings: InRunRecoveryConfig, shard_set: NemoGymShardSet,
                 coordinator: GymCheckpointCoordinator | None, store: RunStore, host: RecoveryHost,
                 log_dir: Path, hooks: RunHooks):
        self.name = instance
        self.label = f"Gym {instance}"
        self.settings = settings
        self.shard_set = shard_set
        self.coordinator = coordinator
        self.store = store
        self.host = host
        self.log_dir = log_dir
        self.hooks = hooks
        self.lost: Loss | None = None  # set at the first notice, until its rollouts are back
        self._reports: asyncio.Queue[Loss] = asyncio.Queue()
        self._affected: list[str] | None = None  # the lost attempts (``live_on``), read once per loss
        self._redispatch: Redispatch | None = None

    # -- the loss stream
    def incarnation(self) -> Any:
        """The replica's actor now (None once given up): a notice about an older one is stale."""
        return self.shard_set.checkpoint_handles.get(self.name)

    def report(self, loss: Loss) -> None:
        """A rollout or a snapshot noticed the loss first: the replica is taken over now (not when the
        supervisor gets to it), and the loss joins the watch's stream."""
        if loss.incarnation is not self.incarnation() or self.lost is not None:
            return  # about an actor already replaced, or a loss already taken over
        self._take(loss)
        self._reports.put_nowait(loss)

    def _take(self, loss: Loss) -> None:
        """No new rollout goes to the replica, and any snapshot stops asking it (it leaves the one under way)."""
        if self.lost is not None:
            return
        self.lost = loss
        self.shard_set.recovering.add(self.name)
        if self.coordinator is not None:
            self.coordinator.abandon(self.name, f"{self.name} lost {loss.component}: {loss.cause}")

    async def failing_servers(self, within_s: float = 2.0) -> list[str]:
        """Its servers whose process has exited or is stopped now, as its actor sees them (none if the actor
        does not answer within ``within_s``: a lost actor is reported by the call that met it)."""
        handle = self.incarnation()
        if handle is None or self.lost is not None:
            return []
        try:
            return await asyncio.wait_for(handle.failing_servers.remote(), within_s)
        except Exception as exc:  # noqa: BLE001 - asked in passing; the watch and the calls report a lost actor
            logger.info("%s: could not ask which servers failed: %s", self.name, describe(exc))
            return []

    def log_of(self, server: str) -> Path:
        inst = self.shard_set.instances[self.name]
        return self.log_dir / "gym-instances" / inst.shard_name / f"replica-{inst.replica_index}" / f"{server}.log"

    async def watch(self) -> Loss:
        """The replica's next loss: its watch's, or a report that came first (both owned and ended here)."""
        handle = self.incarnation()
        watching = asyncio.ensure_future(self._watch_once(handle))
        reported = asyncio.ensure_future(self._next_report(handle))
        try:
            done, _ = await asyncio.wait({watching, reported}, return_when=asyncio.FIRST_COMPLETED)
            loss = reported.result() if reported in done else watching.result()
            self._take(loss)  # before any other await: a report arriving meanwhile is this loss's
            return self.lost or loss
        finally:
            for task in (watching, reported):
                task.cancel()
            await asyncio.gather(watching, reported, return_exceptions=True)

    async def _next_report(self, handle: Any) -> Loss:
        """The next report about this incarnation (one about an actor replaced since is dropped)."""
        while True:
            loss = await self._reports.get()
            if loss.incarnation is handle:
                return loss

    async def _watch_once(self, handle: Any) -> Loss:
        """``NemoGym.watch`` of this actor as a ``Loss``; a watch that fails for any other reason than a lost
        actor is a loss too: the replica is replaced, so it is supervised again (never silently not)."""
        try:
            self.hooks.reached("watch", self.name)
            lost = await handle.watch.remote(self.settings.hung_after_s)
        except ray.exceptions.RayActorError as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            return Loss(self.name, "replica", f"its Ray actor died ({first[:200]})", "watch", handle)
        except Exception as exc:  # noqa: BLE001 - a watch that cannot say is a replica nobody watches
            logger.error("the watch of %s failed (%s); the replica is replaced so that it is watched again",
                         self.name, describe(exc))
            return Loss(self.name, "replica", f"its watch failed ({describe(exc)})", "watch", handle)
        return Loss(self.name, lost["server"], lost["cause"], "watch", handle, log=lost["log"],
                    log_tail=lost["log_tail"])

    # -- the recovery
    async def replace(self, loss: Loss, deadline: float) -> str:
        """Its rollout tasks stop (the recovery owns their attempts), the old actor and its servers go (their
        processes gone first), a new replica starts in the slot."""
        await self._stop_rollouts()
        try:
            await self.shard_set.replace(self.name, self.settings.placement_timeout_s,
                                         gone_within_s=max(0.1, deadline - time.monotonic()))
        except ReplicaNotPlaced as exc:
            raise NotPlaced(str(exc)) from None
        finally:
            write_json_atomic(self.log_dir / "gym_placement.json", self.shard_set.placement)
        self._forget_old()
        return "replaced" if loss.component == "replica" else "restarted"

    def _forget_old(self) -> None:
        """The old servers are gone: nothing is owed to them, and the coordinator may talk to the replica's
        new servers again (the recovery's install does; snapshots still pass it over while it is recovering)."""
        if self.coordinator is not None:
            self.coordinator.forget_instance(self.name)

    async def give_up(self, loss: Loss, why: str, record: RecoveryRecord) -> None:
        """Drop the replica; its rollouts move to its shard's others (``resume``). With none left the run
        stops, naming the server, the replica, why, its log and the log's last lines."""
        if not self.shard_set.survivors(self.name):
            log = loss.log or (str(self.log_of(loss.component)) if loss.component != "replica" else None)
            tail = loss.log_tail or _tail(log)
            where = f"; its log {log}, last lines:\n{tail}" if log else ""
            raise RecoveryFailed(
                f"Gym server {loss.component!r} of {self.name} was lost ({loss.cause}) and the replica is given up: "
                f"{why}; shard {self.shard_set.shard_of(self.name)!r} has no other replica, so the run stops{where}")
        logger.warning("Gym %s is given up (%s); its rollouts move to %s", self.name, why,
                       ", ".join(self.shard_set.survivors(self.name)))
        await self._stop_rollouts()
        self.shard_set.drop(self.name)
        write_json_atomic(self.log_dir / "gym_placement.json", self.shard_set.placement)
        self._forget_old()

    async def _stop_rollouts(self) -> None:
        await self.host.stop_rollouts(self.name)
        if self._affected is None:
            self._affected = self.host.ledger().live_on(self.name)

    async def resume(self, loss: Loss, record: RecoveryRecord) -> None:
        """Install the lost attempts the newest snapshot holding this replica's rollouts saved (on the new
        replica, or dealt over the shard's others when it was given up); the ledger continues those at their
        next attempt and restarts the rest from their prompt. No await between the install and the ledger."""
        await self._stop_rollouts()  # a loss given up before any start
        affected, moved = self._affected or [], record.action == "moved"
        installed = await self._install(affected, moved, loss, record)
        summary = self.host.ledger().bring_back(installed.attempts, installed.relocated, lost=affected)
        saved = set(installed.saved_keys)
        record.continued_replay = sorted(saved_key(k) for k in installed.replayed)
        record.continued_prefix = sorted(saved_key(k) for k, n in installed.cuts.items()
                                         if n and k not in installed.replayed)
        record.continued_turn = sorted(saved - set(record.continued_prefix) - set(record.continued_replay))
        record.restarted_from_prompt = sorted(set(affected) - saved)
        record.kept_siblings = len(summary.kept_siblings)
        self._redispatch = Redispatch(set(summary.restored_turn + summary.restarted_from_prompt))
        self.shard_set.recovering.discard(self.name)
        if moved:
            self.store.hold(self._hold_name, None)  # its rollouts live elsewhere now
        self.lost, self._affected = None, None
        await self.host.notify()

    async def _install(self, affected: list[str], moved: bool, loss: Loss, record: RecoveryRecord
                       ) -> InstalledEpisodes:
        """The lost attempts the snapshot held for this replica saved (``RunStore.holding``), installed through
        the one path a relaunch takes; anything that fails leaves them to restart from the prompt."""
        holding = self.store.holding(self._hold_name)
        if self.coordinator is None or holding is None:
            return InstalledEpisodes()
        path, held_since = str(holding[0]), holding[1]
        record.snapshot, record.snapshot_age_s = path, round(max(0.0, loss.at - held_since), 3)
        if not affected:
            return InstalledEpisodes()
        owner = f"recovery:{self.name}"
        self.store.hold(owner, path)  # neither a publish's nor a trainer-step prune takes it meanwhile
        try:
            index = await asyncio.to_thread(self.store.read_gym_index, Path(path))
            wanted = set(affected)
            saved = {server: [k for k in keys if k in wanted] for server, keys in index.exported().get(self.name, {}).items()}
            replay = frozenset(index.replayed_keys(self.name) & wanted)
            # A move installs into the shard's other replicas that are not being recovered themselves, not
            # while a snapshot's pause holds them.
            targets = [iid for iid in self.shard_set.survivors(self.name) if iid not in self.shard_set.recovering]
            async with self.coordinator.guards.hold(targets if moved else []):
                return await install_episodes(self.coordinator, [SavedIn(path, index, {self.name: saved}, replay)],
                                              purpose="recover", running=targets if moved else [self.name])
        except Exception as exc:  # noqa: BLE001 - unreadable or refused: those rollouts restart from the prompt
            logger.warning("recovery of %s could not restore from %s (%s); its rollouts restart from the prompt",
                           self.name, path, describe(exc))
            return InstalledEpisodes()
        finally:
            self.store.hold(owner, None)

    async def settle(self, loss: Loss, record: RecoveryRecord) -> None:
        """Until the first rollout it brought back went to Gym again (at most ``REDISPATCH_WAIT_S``), then a
        snapshot is asked for, so they are saved again at their new attempt."""
        waiting = self._redispatch
        if waiting is None:
            return
        try:
            if waiting.keys:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(waiting.sent.wait(), REDISPATCH_WAIT_S)
        finally:
            if waiting.first is not None:
                record.seconds_to_redispatch = round(waiting.first - loss.noticed, 3)
            if self._redispatch is waiting:
                self._redispatch = None
        self.host.request_snapshot(f"recovery of {self.name}")

    # -- what the controller tells it
    def dispatched(self, rollout_id: str) -> None:
        if self._redispatch is not None:
            self._redispatch.dispatched(rollout_id)

    @property
    def _hold_name(self) -> str:
        return REPLICA_HOLD + self.name  # the newest snapshot that saved its rollouts (the snapshotter moves it)

    def line(self, record: RecoveryRecord) -> str:
        verb = {"restarted": "restarted", "replaced": "replaced", "moved": "moved to the shard's other replicas",
                "given_up": "given up, the run stops"}
        what = f"{record.part} {record.cause}" if record.part != "replica" else record.cause
        return (f"recovered {self.name}: {what}; {verb[record.action]}{took(record)}; "
                f"{len(record.continued_turn)} rollouts continue at their turn, "
                f"{len(record.continued_prefix)} from a generation cut, "
                + (f"{len(record.continued_replay)} by replay, " if record.continued_replay else "") +
                f"{len(record.restarted_from_prompt)} restart from the prompt")

    def gauges(self) -> dict[str, float]:
        return {}


def _tail(log: str | None, lines: int = 20) -> str:
    if not log:
        return ""
    try:
        return "\n".join(Path(log).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""

