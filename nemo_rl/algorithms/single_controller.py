"""The single controller: prompts in, trained steps out, rollouts snapshotted on the way.

Read top to bottom: ``run`` restores (if a checkpoint exists), then each step
waits for its prompt groups to be complete, trains on them, refits generation
and saves a trainer checkpoint. Meanwhile a dispatcher reserves groups and sends
their rollouts to Gym as upstream's ``in_order`` sampler admits them
(``admission.py``): with ``async_rl.sampler.max_lookahead_versions`` L > 0 the
groups of the next L steps generate while a step trains, refits and checkpoints.
A pump takes rollout snapshots at any moment (docs/design.md §5.4): each belongs
to the newest durable trainer step (its anchor), and the groups trained after
that anchor stay complete in the ledger, with their samples, until the next
checkpoint is published, so a restore (§5.5) trains them again. Every task
(rollouts, the dispatcher, the pump) belongs to one ``asyncio.TaskGroup`` owned
by ``run``: an error in any of them stops the run and is raised from ``run``.
Waits are on events (a rollout ending, a ledger transition, a step completing),
except three on a clock: the pump's schedule (``snapshot_attempt_interval_s``), the
stall watchdog (every ``async_rl.stall_watchdog.interval_s``) and, while Gym
prepares, the coordinator's prepare round, which ticks every 100 ms
(docs/design.md §5.8). Training, refit and file writes run off
the event loop, so lease renewals and rollouts keep going meanwhile.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import contextlib
import logging
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import ray

from nemo_rl.algorithms.single_controller_utils.admission import InOrderAdmission
from nemo_rl.algorithms.single_controller_utils.config import MasterConfig
from nemo_rl.algorithms.single_controller_utils.coverage import SnapshotCoverage
from nemo_rl.algorithms.single_controller_utils.dispatch import LedgerChanges
from nemo_rl.algorithms.single_controller_utils.gym_coordinator import (
    GymCheckpointCoordinator,
    GymCheckpointOperationError,
    is_transient_gym_checkpoint_failure,
)
from nemo_rl.algorithms.single_controller_utils.interfaces import GenerationBackend, Trainer
from nemo_rl.algorithms.single_controller_utils.recovery import build_recovery
from nemo_rl.algorithms.single_controller_utils.run_records import RunRecords
from nemo_rl.algorithms.single_controller_utils.stall_watchdog import StallWatchdog
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot import (
    RestoreLookup,
    RolloutSnapshotter,
    RunRestorer,
    SnapshotInputs,
)
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.snapshotter import RELAUNCH
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.store import RunStore, TrainerBookkeeping
from nemo_rl.data.dataloader import PromptDataloader
from nemo_rl.environments.nemo_gym import GymCheckpointParked, GymRolloutError, NemoGymShardSet
from nemo_rl.experience.data_plane import DataPlaneStore
from nemo_rl.experience.rollout_recovery import (
    PromptGroupStatus,
    RolloutAttemptStatus,
    RolloutRecoveryLedger,
    RolloutRetriesExhausted,
)
from nemo_rl.experience.rollouts import sample_from_run_reply
from nemo_rl.utils.loggers import MetricLoggers
from nemo_rl.parity.trace import trace_of_step, write_step_trace
from nemo_rl.utils.run_hooks import RunHooks
from nemo_rl.algorithms.single_controller_utils.run_identity_check import record_run_identity
from nemo_rl.utils.startup_clock import StartupClock
from nemo_rl.utils.stop_signals import RunStopped
from nemo_rl.utils.write_errors import as_write_error

logger = logging.getLogger(__name__)
# A /run Gym refuses while closed for a checkpoint is dispatched again after resume, at most this often.
MAX_REFUSALS_PER_ATTEMPT = 20
# A failed final snapshot is tried again only while at least this much of the stop's budget is left.
FINAL_SNAPSHOT_RETRY_MIN_S = 1.0
ACTIVITY_TIMEOUT_S = 2.0  # each agent's answer to the stall watchdog's activity call
# Infra failures that mean a Gym server did not answer: new rollouts prefer another replica meanwhile.
_UNANSWERED_CODES = ("rollout_timeout", "upstream_timeout", "server_dead", "server_stopped")


def _first_error(group: BaseExceptionGroup) -> BaseException:
    """The error that stopped the task group (not the cancellations it caused)."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first_error(exc)
        if not isinstance(exc, asyncio.CancelledError):
            return exc
    return group.exceptions[0]


def prefix_continuations(samples: list) -> dict[str, Any]:
    """The step row's record of model calls that continued from a generation cut (target_level prefix):
    how many and the tokens reused, and per call which cut (call id, token count, digest), the tokens it
    generated in all and a digest of its first ``token_count`` (what the trainer got from the cut)."""
    calls = []
    for sample in samples:
        for index, call in enumerate(sample.calls):
            if call.prefix is None:
                continue
            n = call.prefix.token_count
            calls.append({"rollout_id": sample.rollout_id, "call": index, "call_id": call.prefix.call_id,
                          "token_count": n, "digest": call.prefix.digest, "discarded": call.prefix.discarded,
                          "generation_tokens": len(call.generation_token_ids),
                          "prefix_sha256": hashlib.sha256(
                              json.dumps(call.generation_token_ids[:n]).encode()).hexdigest()})
    if not calls:
        return {}
    kept = [c for c in calls if c["discarded"] is None]
    return {"prefix_continued_calls": len(kept), "prefix_reused_tokens": sum(c["token_count"] for c in kept),
            "prefix_discarded_calls": len(calls) - len(kept), "prefix_continuations": calls}


def replay_counts(samples: list, servers_of: Callable[[str], tuple[str, str | None]]) -> dict[str, Any]:
    """The step row's record of rollouts that came back by replay (docs/design.md §4.8): how many, the calls
    played back from their record, the calls generated live after a divergence, and where each divergence
    happened (the rollout, the call index, and the server whose output differed: the resources server for a
    tool's output, else the agent; ``servers_of(group_id)`` gives the group's agent and resources server)."""
    replayed = live = rollouts = 0
    sites = []
    for sample in samples:
        notes = [(i, call.replay) for i, call in enumerate(sample.calls) if call.replay is not None]
        if not notes:
            continue
        rollouts += 1
        replayed += sum(1 for _, note in notes if note.replayed)
        for i, note in notes:
            if note.divergence is not None:
                live += len(sample.calls) - i
                agent, resources = servers_of(sample.group_id)
                server = resources if note.divergence.kind == "tool_output" and resources else agent
                sites.append({"rollout_id": sample.rollout_id, "call": note.divergence.call, "server": server,
                              "kind": note.divergence.kind, "tool": note.divergence.tool})
    if not rollouts:
        return {}
    return {"replay_rollouts": rollouts, "replay_calls_replayed": replayed, "replay_calls_live_after_divergence": live,
            "replay_divergences": len(sites), "replay_divergence_sites": sites}


async def _prune_steps(store: RunStore, keep_top_k: int | None, newest: int, checkpoint_dir: Path) -> None:
    """``store.prune_steps`` off the event loop; a read-only or failing disk names what it could not remove."""
    try:
        await asyncio.to_thread(store.prune_steps, keep_top_k, newest)
    except OSError as exc:
        raise as_write_error(exc, None if exc.filename else checkpoint_dir) from exc


class SingleController:
    def __init__(
        self,
        config: MasterConfig,
        shard_set: NemoGymShardSet,
        trainer: Trainer,
        generation: GenerationBackend | None,
        rows: list[dict[str, Any]],
        *,
        val_rows: list[dict[str, Any]] | None = None,
        on_progress: Callable[[dict[str, Any]], None] | None = None,
        startup: StartupClock | None = None,
        loggers: MetricLoggers | None = None,  # the metric backends (opened and closed by the runner)
        hooks: RunHooks | None = None,  # where tests act (crash points); none: the product's no-op
        restore_lookup: RestoreLookup | None = None,  # the runner's one lookup at start; none: look here
        store: RunStore,  # the one owner of checkpoint_dir's layout, with the run's writer (docs/design.md §5.4)
    ):
        self.config = config
        self.hooks = hooks or RunHooks()
        self.restore_lookup = restore_lookup
        self.startup = startup or StartupClock(None)
        self.val_rows = list(val_rows or [])
        self.shard_set = shard_set
        self.trainer = trainer
        self.generation = generation
        self.rows = rows
        self.on_progress = on_progress or (lambda _: None)
        self.checkpoint_dir = Path(config.checkpointing.checkpoint_dir)
        if store.checkpoint_dir != self.checkpoint_dir:
            raise ValueError(f"store of {store.checkpoint_dir}, but checkpointing.checkpoint_dir is {self.checkpoint_dir}")
        self.store = store
        self.records = RunRecords(config.logger.log_dir, config.logger.metrics_file, loggers)
        self.ledger = RolloutRecoveryLedger(config.async_rl.rollout_failure.max_infra_attempts_per_prompt)
        self.data_plane = DataPlaneStore()
        self.dataloader = PromptDataloader(rows, seed=config.data.seed, shuffle=config.data.shuffle)
        self.step = 0  # trained steps: the weights of this step are what generation serves
        self.anchor_step = 0  # newest published trainer step; snapshots hang under it
        self.admission = InOrderAdmission.from_config(config)
        # Groups the trainer took after the anchor, per step: complete in the ledger, samples kept,
        # until their step's checkpoint is published (a snapshot meanwhile must let a restore redo them).
        self._trained_pending: dict[int, list[str]] = {}
        self.changes = LedgerChanges()
        self._rollouts: dict[str, asyncio.Task] = {}
        self._rollout_on: dict[str, str] = {}  # rollout in flight -> the replica running it
        self.coverage = SnapshotCoverage(config.rollout_checkpointing.snapshot_attempt_interval_s)
        self.snapshot_counts = {"committed": 0, "failed": 0}
        self._pruned_sparing: frozenset[int] = frozenset()  # the anchors the last trainer-step prune spared (§5.4)
        recovery = config.rollout_recovery
        self.coordinator = (
            GymCheckpointCoordinator(
                shard_set,
                recovery.gym_prepare_timeout_s,
                "best_effort" if recovery.allow_restart_only_gym_servers else "block",
                park_grace_s=recovery.gym_park_grace_s,
                recovers_lost=recovery.in_run.enabled,
            )
            if recovery.turn_checkpointing_enabled and config.checkpointing.enabled
            else None
        )
        self.snapshotter: RolloutSnapshotter | None = None  # built after restore, over the restored state
        # Stop signals (docs/design.md §5.11): the runner calls request_stop / request_snapshot on the loop.
        self._stop_reason: str | None = None
        self._stop_requested = asyncio.Event()
        self._snapshot_request = asyncio.Event()
        self._requested_by: str | None = None
        self.stop_budget_s: Callable[[], float] = lambda: config.rollout_checkpointing.stop_grace_s
        # In-run recovery (docs/design.md §5.12): one object, a null one when rollout_recovery.in_run is off.
        self.recovery = build_recovery(config, shard_set, self.coordinator, generation, trainer, store,
                                       self.records, _Host(self), self.hooks)
        self.watchdog = StallWatchdog(
            config.async_rl.stall_watchdog, in_flight=lambda: len(self._rollouts),
            transitions=lambda: self.changes.count, activity=self._gym_activity,
        )

    @property
    def dispatch_open(self) -> bool:
        if self._stop_reason is not None:
            return False  # stopping: admission closed for good
        return self.snapshotter is None or self.snapshotter.gate.is_open

    # ------------------------------------------------------------------ run
    async def run(self) -> dict[str, Any]:
        """Restore, then train; rollouts and the snapshot pump are tasks of one group owned here."""
        await self.restore_if_any()
        self.startup.mark("restore")
        if self.config.checkpointing.enabled:
            self.snapshotter = RolloutSnapshotter(
                SnapshotInputs(
                    self.ledger, self.data_plane, self.dataloader, lambda: self.step, lambda: self.anchor_step,
                    self.anchor_dir,
                    agent_servers={iid: self.shard_set.agent_servers.get(inst.shard_name, {})
                                   for iid, inst in self.shard_set.instances.items()},
                    replay_models={iid: self.shard_set.replay_models.get(inst.shard_name, {})
                                   for iid, inst in self.shard_set.instances.items()},
                    generation_cuts=self.config.rollout_recovery.generation_cuts_enabled,
                ),
                self.coordinator, self.records, self.config.rollout_checkpointing, self.changes, hooks=self.hooks,
                store=self.store, recovers=self.recovery.recovers,
            )
        try:
            async with asyncio.TaskGroup() as tasks:
                background = [tasks.create_task(self._snapshot_pump(), name="rollout-snapshot-pump"),
                              tasks.create_task(self.watchdog.run(), name="stall-watchdog"),
                              tasks.create_task(self._stop_when_asked(), name="stop-on-signal"),
                              tasks.create_task(self.recovery.run(), name="in-run-recovery")]
                try:
                    await self._train(tasks)
                finally:
                    for task in [*background, *self._rollouts.values()]:
                        task.cancel()
        except BaseExceptionGroup as group:
            raise _first_error(group) from None
        finally:
            if self.coordinator is not None:
                await self.coordinator.aclose()
        return {"step": self.step, "trained_groups": self.ledger.trained_count,
                "trained_positions": [list(r) for r in self.ledger.trained_positions],
                "snapshot_coverage": self.coverage.share(),
                "gym_recoveries": self.recovery.counts().get("gym_replica", 0),
                "generation_recoveries": self.recovery.counts().get("generation", 0)}

    async def _train(self, tasks: asyncio.TaskGroup) -> None:
        grpo = self.config.grpo
        if grpo.val_at_start and self.step == 0 and self.val_rows:
            self.records.metrics({"step": 0, **await self._validate(tasks)})
        dispatcher = tasks.create_task(self._dispatch_loop(tasks), name="rollout-dispatch")
        try:
            while self.step < grpo.max_num_steps:
                await self._train_step(tasks)
        finally:
            dispatcher.cancel()

    async def _train_step(self, tasks: asyncio.TaskGroup) -> None:
        """One step: wait for its groups (training as they complete when streaming), refit, checkpoint."""
        grpo, target = self.config.grpo, self.step + 1
        t0 = time.monotonic()
        groups, samples, metrics, wait_s, train_s = await self._consume_step(target)
        if grpo.deterministic:  # before the checkpoint: a step whose checkpoint exists has its record
            trace = trace_of_step(self.trainer, samples, grpo.normalize_rewards)
            await asyncio.to_thread(write_step_trace, self.config.logger.log_dir, target, trace)
        # Versions behind the weights this step trains from, by when each group began (the sampler bounds it).
        lags = [target - 1 - v for g in groups if (v := self.ledger.groups[g].start_weight_version) is not None]
        self.hooks.reached("train")  # batch consumed, step not checkpointed
        self._took(target, groups)
        refit_s = 0.0
        self.hooks.reached("refit")  # the new weights go to generation, rollouts of later steps in flight
        if self.generation is not None:
            t1 = time.monotonic()
            await asyncio.to_thread(self.generation.refit, self.trainer)
            refit_s = time.monotonic() - t1
        self.step = target
        await self.changes.notify(transition=False)  # the admission window moved on
        record = {
            "step": self.step,
            "reward_mean": sum(s.reward for s in samples) / max(1, len(samples)),
            "weight_version": self.trainer.weight_version,
            "generation_s": round(wait_s, 3),  # waiting for the step's groups (not training meanwhile)
            "training_s": round(train_s, 3),
            "refit_s": round(refit_s, 3),
            "inflight_rollouts": len(self._rollouts),  # of later steps, generating across this step's end
            "max_group_version_lag": max(lags, default=0),
            "groups": groups,
            "snapshots_committed": self.snapshot_counts["committed"],
            "snapshots_failed": self.snapshot_counts["failed"],
            **prefix_continuations(samples),
            **replay_counts(samples, self._servers_of),
            **self.recovery.step_metrics(),
            **{k: v for k, v in metrics.items() if k not in ("step",)},
        }
        if grpo.val_period and self.step % grpo.val_period == 0 and self.val_rows:
            record.update(await self._validate(tasks))
        last = self.step == grpo.max_num_steps
        if self.config.checkpointing.enabled and (self.step % self.config.checkpointing.save_period == 0 or last):
            try:
                record["checkpoint_s"] = round(await self.save_trainer_checkpoint(dict(record)), 3)
            except Exception:
                with contextlib.suppress(Exception):  # the step trained: its row stays, the checkpoint error is raised
                    self.records.metrics(record)
                raise
            record["step_s"] = round(time.monotonic() - t0, 3)
            record["snapshot_coverage"] = self.coverage.share()
            self.records.metrics(record)  # after the checkpoint, so the row carries checkpoint_s
            await self._forget_trained()
        else:
            record["step_s"] = round(time.monotonic() - t0, 3)
            record["snapshot_coverage"] = self.coverage.share()
            self.records.metrics(record)
        self.on_progress(record)

    async def _consume_step(self, target: int) -> tuple[list[str], list, dict[str, Any], float, float]:
        """Train step ``target`` on its groups: in one call once all are complete or, with
        ``async_rl.min_groups_for_streaming_train`` below the step's group count, group by group into
        one optimizer step, starting once that many are complete. Returns the groups (in dataloader
        order), their samples, the metrics, and the seconds spent waiting and training."""
        per_step = self.config.grpo.num_prompts_per_step
        first = self.config.async_rl.min_groups_for_streaming_train or per_step
        taken: list[str] = []
        waited = trained = 0.0

        def complete() -> list[str]:
            ready = [g for g in self.ledger.groups.values() if g.target_step == target
                     and g.status is PromptGroupStatus.COMPLETE and g.group_id not in taken]
            return [g.group_id for g in sorted(ready, key=lambda g: g.position)]

        async def wait_for(count: int) -> list[str]:
            nonlocal waited
            t0 = time.monotonic()
            await self.changes.wait_for(lambda: len(complete()) >= count)
            waited += time.monotonic() - t0
            return complete()[: per_step - len(taken)]

        async def off_loop(fn, *args):
            nonlocal trained
            t0 = time.monotonic()
            try:
                return await asyncio.to_thread(fn, *args)
            finally:
                trained += time.monotonic() - t0

        def samples_of(groups: list[str]) -> list:
            return [s for g in groups for s in self.data_plane.group_samples(g)]

        if first >= per_step:
            taken = await wait_for(per_step)
            metrics = await off_loop(self.trainer.train_step, samples_of(taken))
        else:
            streaming = self.trainer.open_step()
            try:
                while len(taken) < per_step:
                    batch = await wait_for(first if not taken else 1)
                    await off_loop(streaming.add, samples_of(batch))
                    taken += batch
                metrics = await off_loop(streaming.finish)
            except BaseException:
                with contextlib.suppress(Exception):  # the run is stopping; free the trainer, keep the error
                    streaming.abort()
                raise
        return taken, samples_of(taken), metrics, waited, trained

    def _took(self, step: int, groups: list[str]) -> None:
        """The trainer consumed these groups. Without checkpoints nothing can redo them: trained now.
        Otherwise they stay complete, samples kept, until ``step``'s checkpoint is published."""
        if self.config.checkpointing.enabled:
            self._trained_pending[step] = list(groups)
            return
        for g in groups:
            self.ledger.mark_group_trained(g)
            self.data_plane.discard(s.rollout_id for s in self.data_plane.group_samples(g))
        self.anchor_step = step

    # ------------------------------------------------------------ validation
    async def _validate(self, tasks: asyncio.TaskGroup) -> dict[str, Any]:
        """One rollout per validation row with the current weights; never trained, never snapshotted.
        Snapshots go on meanwhile (in async mode later steps' groups keep generating, and a crash
        during validation must not lose them): a snapshot pauses validation rollouts with the rest,
        they are in no commit scope, and Gym forgets them once done (docs/design.md §5.6)."""
        t0 = time.monotonic()
        tag = uuid.uuid4().hex[:12]
        rollout_ids = [f"val_s{self.step}_{i}_{tag}" for i in range(len(self.val_rows))]

        async def one(i: int, row: dict[str, Any]) -> float | None:
            instance = self.shard_set.pick_instance((row.get("agent_ref") or {}).get("name") or "")
            if instance is None:
                logger.warning("validation rollout %d skipped: every replica of its shard is being recovered", i)
                return None
            handle = self.shard_set.handle_for(instance)
            try:
                reply = await self.shard_set.run_rollout(instance, row, rollout_ids[i])
            except GymRolloutError as exc:
                if not exc.infra:
                    raise
                self.recovery.claims(instance, handle, exc)  # a dead server is recovered; the rollout is lost
                logger.warning("validation rollout %d failed on %s: %s", i, instance, exc)
                return None
            except ray.exceptions.RayActorError as exc:
                self.recovery.actor_lost(instance, handle, exc)  # without in-run recovery: the run stops
                logger.warning("validation rollout %d failed on %s: its replica was lost", i, instance)
                return None
            self.hooks.reached("validate", self.step)
            return float(reply["reward"])

        runs = [tasks.create_task(one(i, row), name=f"validation:{i}") for i, row in enumerate(self.val_rows)]
        rewards = [r for r in await asyncio.gather(*runs) if r is not None]
        if self.coordinator is not None:  # Gym keeps per-rollout records until told: drop the validation ones
            try:
                async with self.snapshotter.busy if self.snapshotter is not None else contextlib.nullcontext():
                    await self.coordinator.forget(rollout_ids)  # never under a snapshot's pause
            except GymCheckpointOperationError as exc:
                if not is_transient_gym_checkpoint_failure(exc):
                    raise
                logger.warning("Gym could not forget the validation rollouts (it keeps their records): %s", exc)
        return {
            "val_reward_mean": sum(rewards) / len(rewards) if rewards else None,
            "val_samples": len(rewards),
            "validation_s": round(time.monotonic() - t0, 3),
        }

    # ------------------------------------------------------------ generation
    async def _dispatch_loop(self, tasks: asyncio.TaskGroup) -> None:
        """Reserve what the sampler admits and dispatch what may generate, whenever the ledger, the
        gate or the served step changes; runs for the whole run (``_train`` owns and cancels it)."""
        while True:
            self._reserve_groups()
            if self.dispatch_open:
                for req in self._dispatchable():
                    self._dispatch(tasks, req)
            await self.changes.wait_for(self._dispatch_work)

    def _dispatchable(self) -> list:
        groups, step = self.ledger.groups, self.step
        return [req for req in self.ledger.reserved_attempts()
                if self.admission.may_generate(groups[req.group_id], step) and self._placeable(req)]

    def _placeable(self, req) -> bool:
        """A replica can take it now: the one it is pinned to is not being recovered, or its shard has
        one that is not (docs/design.md §5.12)."""
        recovering = self.shard_set.recovering
        if not recovering:
            return True
        if req.gym_instance_id is not None:
            return req.gym_instance_id not in recovering
        shard = self.shard_set.agent_shards.get(self.ledger.groups[req.group_id].agent_name or "")
        return shard is None or any(self.shard_set.instances[iid].shard_name == shard and iid not in recovering
                                    for iid in self.shard_set.checkpoint_handles)

    def _dispatch_work(self) -> bool:
        """Whether the dispatcher has something to do (checked at every ledger change: no lists built)."""
        if self.dispatch_open:
            groups, step = self.ledger.groups, self.step
            if any(self.admission.may_generate(groups[r.group_id], step) and self._placeable(r)
                   for r in self.ledger.reserved_attempts()):
                return True
        return bool(self.admission.reservations(self.ledger, self.step, self._consumed()))

    def _consumed(self) -> set[str]:
        return {g for groups in self._trained_pending.values() for g in groups}

    def _reserve_groups(self) -> None:
        """Reserve the groups the sampler admits now (targets in order), at positions not yet trained or held."""
        recovery = self.config.rollout_recovery
        for target_step in self.admission.reservations(self.ledger, self.step, self._consumed()):
            while self.ledger.is_held_position(self.dataloader.position):
                self.dataloader.next_index()  # after a restore: trained by a newer step, or restored from a snapshot
            position = self.dataloader.position  # monotonic over the run (across epochs): the group's key
            index = self.dataloader.next_index()
            row = self.rows[index]
            agent = (row.get("agent_ref") or {}).get("name")
            task_source = row.get("task_source")
            group_id = f"s{target_step}p{position}"
            self.ledger.reserve_group(
                group_id=group_id,
                prompt_id=str(row.get("id", index)),
                prompt_index=index,
                task_source=task_source,
                agent_name=agent,
                restore_level=recovery.resolve_for(task_source, agent),
                num_generations=self.config.grpo.num_generations_per_prompt,
                target_step=target_step,
                position=position,
            )

    def _dispatch(self, tasks: asyncio.TaskGroup, req) -> None:
        group = self.ledger.groups[req.group_id]
        row = self.rows[group.prompt_index]
        instance = req.gym_instance_id or self.shard_set.pick_instance(group.agent_name or "")
        if instance is None:
            return  # every replica of its shard is being recovered (``_placeable`` normally holds it back)
        self.ledger.mark_dispatched(req.rollout_id, instance, weight_version=self.step)
        self.startup.mark("first_dispatch")
        self.recovery.dispatched(req.rollout_id)
        self.coverage.in_flight(len(self._rollouts) + 1)
        self._rollout_on[req.rollout_id] = instance
        self._rollouts[req.rollout_id] = tasks.create_task(
            self._run_rollout(req.rollout_id, req.group_id, req.generation_index, instance, row),
            name=f"rollout:{req.rollout_id}",
        )

    async def _run_rollout(self, rollout_id: str, group_id: str, g: int, instance: str, row: dict) -> None:
        """One ``/run``; every outcome is a ledger transition, and waiters are woken after it.

        Infra failures retry from the prompt (bounded by the ledger); a refusal
        (Gym closed for a checkpoint) puts the attempt back for dispatch after
        resume (bounded here); anything else is raised and stops the run.
        """
        handle = self.shard_set.handle_for(instance)
        try:
            try:
                reply = await self.shard_set.run_rollout(instance, row, rollout_id)
            except ray.exceptions.RayActorError as lost:
                # The recovery takes its attempt over, with every other one on that replica (§5.12); without
                # in-run recovery the run stops, naming the replica.
                self.recovery.actor_lost(instance, handle, lost)
                return
            except GymCheckpointParked:
                refusals = self.ledger.mark_refused(rollout_id, MAX_REFUSALS_PER_ATTEMPT)
                logger.warning("Gym instance %s refused rollout %s while closed for a checkpoint (%d/%d); "
                               "it is dispatched again after resume", instance, rollout_id, refusals,
                               MAX_REFUSALS_PER_ATTEMPT)
            except GymRolloutError as exc:
                if exc.code == "stale_attempt":
                    return
                if not exc.infra:
                    raise
                if self.recovery.claims(instance, handle, exc):
                    return  # a server of the replica died: a recovery, not a failure of this rollout (§5.12)
                reason = str(getattr(exc, "cause", None) or exc)  # not Ray's traceback wrapper
                logger.warning("rollout %s failed on %s of %s (%s); retrying from the prompt", rollout_id,
                               exc.server, instance, reason)
                self.recovery.went_to_prompt(rollout_id)
                if exc.code in _UNANSWERED_CODES:
                    self.shard_set.mark_unhealthy(instance, reason)  # the retry prefers a healthy replica
                try:
                    self.ledger.mark_failed(rollout_id)
                except RolloutRetriesExhausted as exhausted:
                    raise RuntimeError(
                        f"Gym server {exc.server!r} on {instance} keeps failing: {exhausted} "
                        f"(async_rl.rollout_failure.max_infra_attempts_per_prompt="
                        f"{self.ledger.max_attempts_per_sibling}); last error: {reason}"
                    ) from None
            else:
                if self.ledger.attempt_status(rollout_id) is not RolloutAttemptStatus.DISPATCHED:
                    return  # dropped meanwhile
                sample = sample_from_run_reply(
                    reply, rollout_id=rollout_id, group_id=group_id, generation_index=g,
                    prompt_id=self.ledger.groups[group_id].prompt_id, gym_instance_id=instance,
                )
                self.data_plane.put(sample)
                self.ledger.mark_sealed(rollout_id, sample.reward)
        finally:
            self._rollouts.pop(rollout_id, None)
            self._rollout_on.pop(rollout_id, None)
            self.coverage.in_flight(len(self._rollouts))
        await self.changes.notify()

    # -------------------------------------------------------------- snapshots
    async def _snapshot_pump(self) -> None:
        """Every ``snapshot_attempt_interval_s`` while groups generate, whatever the trainer is doing
        (training, refit, checkpoint write): a snapshot belongs to the newest durable trainer step.
        An error here stops the run."""
        interval = self.config.rollout_checkpointing.snapshot_attempt_interval_s
        if self.snapshotter is None:
            return
        while True:
            requested = await self._next_snapshot(interval)  # the schedule or a SIGUSR1, not a poll
            if self._stop_reason is not None:
                return  # the final snapshot is the stop's own
            if requested is None and not any(
                    g.status is PromptGroupStatus.GENERATING for g in self.ledger.groups.values()):
                continue
            # Replicas being recovered sit the snapshot out; the others go on (docs/design.md §5.12).
            outcome = await self.snapshotter.attempt(requested=requested)
            self.snapshot_counts["committed" if outcome.committed else "failed"] += 1
            if outcome.committed:
                self.coverage.committed(outcome.started + outcome.pause_s, outcome.anchor_step)
                if self.store.held_anchors() != self._pruned_sparing:
                    await self._prune_again()

    async def _next_snapshot(self, interval: float | None) -> str | None:
        """Wait for the next scheduled snapshot (None; ``interval`` None: no schedule) or a request
        (SIGUSR1: its name, recorded in the row)."""
        try:
            async with asyncio.timeout(interval):
                await self._snapshot_request.wait()
        except TimeoutError:
            return None
        self._snapshot_request.clear()
        return self._requested_by

    # ------------------------------------------------------------ stop signals
    def request_snapshot(self, by: str) -> None:
        """A snapshot now, out of cadence (SIGUSR1; docs/design.md §5.11). Called on the loop."""
        self._requested_by = by
        self._snapshot_request.set()

    def request_stop(self, by: str) -> None:
        """Stop as a scheduler asks (SIGTERM, a first Ctrl-C): close admission, take a final snapshot,
        raise ``RunStopped`` (docs/design.md §5.11). Called on the loop; a second call changes nothing."""
        if self._stop_reason is None:
            self._stop_reason = by
            self._stop_requested.set()

    async def _stop_when_asked(self) -> None:
        """Waits for ``request_stop``; then no new rollout starts, one last snapshot is taken through
        the normal path within the grace, and the run ends with ``RunStopped`` (its tasks cancelled)."""
        await self._stop_requested.wait()
        stopped = RunStopped(self._stop_reason, step=self.step, anchor_step=self.anchor_step,
                             in_flight=len(self._rollouts))
        await self.changes.notify(transition=False)  # the dispatcher sees admission closed
        if self.snapshotter is not None:
            await self._final_snapshot(stopped, self.stop_budget_s())
        raise stopped

    async def _final_snapshot(self, stopped: RunStopped, budget: float) -> None:
        """Attempts until one commits or the grace's budget is spent: an attempt that failed (a replica
        too busy to answer its probe in time, at thousands of rollouts) is tried again at once while time
        is left; the timeout cancels the last one before it publishes anything torn (docs/design.md §5.11)."""
        deadline = time.monotonic() + budget
        try:
            async with asyncio.timeout(budget):
                while True:
                    stopped.outcome = await self.snapshotter.attempt(requested=self._stop_reason, final=True)
                    stopped.attempts += 1
                    if stopped.outcome.committed:
                        self.snapshot_counts["committed"] += 1
                        return
                    self.snapshot_counts["failed"] += 1
                    if self.coordinator is not None:  # a replica that left the attempt is reopened first
                        await self.coordinator.reopened(deadline - time.monotonic() - FINAL_SNAPSHOT_RETRY_MIN_S)
                    if deadline - time.monotonic() < FINAL_SNAPSHOT_RETRY_MIN_S:
                        return
                    logger.warning("final snapshot attempt %d failed (%s); trying again within the grace "
                                   "(%.1f s left)", stopped.attempts, stopped.outcome.reason,
                                   deadline - time.monotonic())
        except TimeoutError:
            stopped.error = f"it did not finish within {budget:.1f} s of the grace"
        except Exception as exc:  # noqa: BLE001 - a failed final snapshot still ends the run as asked
            stopped.error = f"{type(exc).__name__}: {exc}"

    def anchor_dir(self) -> Path:
        return self.store.anchor(self.anchor_step)

    def _servers_of(self, group_id: str) -> tuple[str, str | None]:
        """A group's agent and the resources server its rollouts call (None: none)."""
        agent = self.ledger.groups[group_id].agent_name or ""
        shard = self.shard_set.agent_shards.get(agent)
        servers = self.shard_set.agent_servers.get(shard or "", {}).get(agent, [])
        resources = self.shard_set.agent_resources.get(shard or "", {}).get(agent)
        return agent, resources if resources in servers else None

    async def _stop_rollouts_on(self, instance: str) -> None:
        """Cancel and await the rollout tasks running on ``instance`` (a recovery takes their attempts
        over; a cancelled rollout task leaves the ledger as it was)."""
        tasks = [task for rid, task in list(self._rollouts.items()) if self._rollout_on.get(rid) == instance]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _gym_activity(self) -> dict[str, dict[str, Any]]:
        """Every replica's agents: what each run in flight is doing (the stall watchdog reads it)."""
        async def one(handle: Any) -> dict[str, Any]:
            try:
                return await asyncio.wait_for(handle.activity.remote(ACTIVITY_TIMEOUT_S), ACTIVITY_TIMEOUT_S + 5.0)
            except (TimeoutError, ray.exceptions.RayError) as exc:
                first = str(exc).splitlines()[0] if str(exc) else ""
                return {"<replica actor>": f"{type(exc).__name__}: {first}"}

        handles = self.shard_set.checkpoint_handles
        answers = await asyncio.gather(*(one(h) for h in handles.values()))  # all at once: one timeout at most
        return dict(zip(handles, answers))

    # ------------------------------------------------------- trainer checkpoints
    async def save_trainer_checkpoint(self, metrics_row: dict[str, Any] | None = None) -> float:
        """Capture the step's bookkeeping here, write the trainer state and publish off the event loop.

        Returns ``checkpoint_s``: seconds of save + publish + prune (not the wait for a snapshot
        still persisting under an old anchor). The seal takes the digests of the files the trainer
        wrote through ``write_bytes_atomic`` as they were written, and pruning only stats: no
        checkpoint is read back. ``step_N/config.yaml`` is the config the step was trained with.
        """
        step = self.step
        config_yaml = self.config.to_yaml().encode()
        taken = [g for s in sorted(self._trained_pending) if s <= step for g in self._trained_pending[s]]
        # Trained positions only (ranges, no growing list). What is in flight is not kept: without a
        # snapshot it restarts from its prompt, the dataloader resuming at the first untrained position.
        ledger_state, resume_at = self.ledger.checkpoint_state(taken)
        dataloader = self.dataloader.state_dict()
        if resume_at is not None:
            dataloader["position"] = min(dataloader["position"], resume_at)
        # metrics_row: written to metrics.jsonl after the save; restore rewrites it if lost
        kept = TrainerBookkeeping(step=step, dataloader=dataloader, ledger=ledger_state, metrics_row=metrics_row)
        t0 = time.monotonic()
        try:
            await asyncio.to_thread(self.store.save_step, step, kept, self.trainer.save, {"config.yaml": config_yaml})
        except OSError as exc:  # not named by the trainer (mkdir, rename): the file the OS names, else the step
            named = as_write_error(exc, None if exc.filename else self.checkpoint_dir / f"step_{step}")
            if named is exc:
                raise
            raise named from exc
        checkpoint_s = time.monotonic() - t0
        # Published: in one step without awaits, these groups become trained and the anchor moves, so
        # a snapshot sees them either complete under the old anchor or trained under the new one.
        for g in taken:
            self.ledger.mark_group_trained(g)
            self.data_plane.discard(s.rollout_id for s in self.data_plane.group_samples(g))
        for s in [s for s in self._trained_pending if s <= step]:
            del self._trained_pending[s]
        self.anchor_step = step
        if not self._rollouts:  # nothing in flight: the checkpoint itself saves all there is
            self.coverage.committed(time.monotonic(), step)
        # Step durable, no snapshot under it yet: here, not after the prune below, which waits for an
        # attempt in flight, and that attempt may publish under this step (re-anchored, §5.9).
        self.hooks.reached("checkpointed")
        # Older anchors go, but not under a snapshot that is still being persisted (``busy``), nor one
        # holding a snapshot the run store holds for a restore (the relaunch's newest until one is
        # published under a newer step, when the pump prunes again; a replica's, a recovery's), and none
        # once the run is complete (its last step is durable: a relaunch restores nothing). A snapshot
        # begun before this publish and published after it under its own, older anchor is that newest
        # one: the snapshotter holds it before it releases ``busy`` (§5.9).
        if step >= self.config.grpo.max_num_steps:
            self.store.hold(RELAUNCH, None)  # the run is complete: its last step is durable, a relaunch restores nothing
        async with (self.snapshotter.busy if self.snapshotter is not None else contextlib.nullcontext()):
            t1 = time.monotonic()
            await self._prune(step)
            return checkpoint_s + (time.monotonic() - t1)

    async def _prune_again(self) -> None:
        """What a restore may need has moved since the last trainer-step prune (a snapshot was published under
        a newer anchor, a recovery let go of an older one): the anchors nobody holds any more go, unless they
        are among the newest ``checkpointing.keep_top_k``."""
        async with self.snapshotter.busy:
            await self._prune(self.anchor_step)

    async def _prune(self, newest: int) -> None:
        """Under ``busy``: trainer steps beyond ``keep_top_k`` go, except anchors holding a snapshot the run
        store holds for a restore (the relaunch's newest, each replica's, a recovery's: ``RunStore.hold``)."""
        self._pruned_sparing = self.store.held_anchors()
        await _prune_steps(self.store, self.config.checkpointing.keep_top_k, newest, self.checkpoint_dir)
        self.coverage.pruned(lambda kept: self.store.anchor(kept).is_dir())

    async def _forget_trained(self) -> None:
        """Trained groups whose step is durable leave the ledger, and Gym forgets their rollouts:
        nothing this run does can bring them back, so neither grows with the length of the run."""
        trained = [g.group_id for g in self.ledger.groups.values() if g.status is PromptGroupStatus.TRAINED]
        rollout_ids = self.ledger.compact_trained(trained)
        if self.coordinator is None or not rollout_ids:
            return
        async with self.snapshotter.busy if self.snapshotter is not None else contextlib.nullcontext():
            try:
                await self.coordinator.forget(rollout_ids)
            except GymCheckpointOperationError as exc:
                if not is_transient_gym_checkpoint_failure(exc):
                    raise
                logger.warning("Gym could not forget %d finished rollouts (it keeps their records): %s",
                               len(rollout_ids), exc)

    # ---------------------------------------------------------------- restore
    async def _load_trainer(self, anchor: Path) -> dict[str, Any]:
        """The trainer state of step ``anchor``, then generation refit to it: the refit ships nothing when
        generation was built from that step's weights (``build_real``) and the load read none."""
        extra = await asyncio.to_thread(self.trainer.load, anchor)
        self.startup.mark("trainer_load")
        if self.generation is not None:
            await asyncio.to_thread(self.generation.refit, self.trainer)
        return extra

    async def restore_if_any(self) -> None:
        """Continue from the newest checkpoint, if any (``rollout_snapshot/restore.py`` does the work)."""
        if not self.config.checkpointing.enabled:
            return  # checkpointing.enabled=false: every start is a new run
        restorer = RunRestorer(
            self.checkpoint_dir,
            read_snapshots=self.config.rollout_checkpointing.restore_mode != "trainer_checkpoint",
            coordinator=self.coordinator,
            max_attempts_per_sibling=self.config.async_rl.rollout_failure.max_infra_attempts_per_prompt,
            load_trainer=self._load_trainer, hooks=self.hooks, store=self.store,
        )
        restored = await restorer.restore(self.restore_lookup)
        self.startup.resumed = restored is not None and restored.step > 0
        if restored is None:
            self.store.ensure_bootstrap({"created": time.time()})
            record_run_identity(self.config)  # the directory now belongs to this run
            return
        self.step = self.anchor_step = restored.step
        self.ledger, self.data_plane = restored.ledger, restored.data_plane
        if restored.dataloader is not None:
            self.dataloader.load_state_dict(restored.dataloader)
        self.records.restore(restored.record)
        if restored.metrics_row is not None and not any(
                row.get("step") == restored.step for row in self.records.read(self.config.logger.metrics_file)):
            # the step is durable but its row was not (the append failed after the checkpoint): write it now
            self.records.metrics({**restored.metrics_row, "row_restored": True})
        print(restored.message, flush=True)


class _Host:
    """What the in-run recovery asks of the controller (``recovery.RecoveryHost``)."""

    def __init__(self, controller: SingleController):
        self.controller = controller

    def ledger(self) -> RolloutRecoveryLedger:
        return self.controller.ledger

    async def stop_rollouts(self, instance: str) -> None:
        await self.controller._stop_rollouts_on(instance)

    async def notify(self) -> None:
        await self.controller.changes.notify()

    def request_snapshot(self, by: str) -> None:
        self.controller.request_snapshot(by)
