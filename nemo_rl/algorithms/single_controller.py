"""The single controller: prompts in, trained steps out, rollouts snapshotted on the way.

Read top to bottom: ``run`` restores (if a checkpoint exists), then for each
step reserves prompt groups, dispatches their rollouts to Gym, seals what
comes back, trains on complete groups, refits generation and saves a trainer
checkpoint. A pump takes rollout snapshots meanwhile (docs/design.md §5.4);
restore follows §5.5. Every task (rollouts, the pump) belongs to one
``asyncio.TaskGroup`` owned by ``run``: an error in any of them stops the run
and is raised from ``run``; nothing polls. Training, refit and file writes run
off the event loop, so lease renewals and rollouts keep going meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import ray

from gym_patches.checkpoint.identity import EpisodeId
from nemo_rl.algorithms.single_controller_utils.config import MasterConfig
from nemo_rl.algorithms.single_controller_utils.dispatch import LedgerChanges
from nemo_rl.algorithms.single_controller_utils.gym_coordinator import (
    GymCheckpointCoordinator,
    GymCheckpointOperationError,
    is_transient_gym_checkpoint_failure,
)
from nemo_rl.algorithms.single_controller_utils.interfaces import GenerationBackend, Trainer
from nemo_rl.algorithms.single_controller_utils.run_records import RunRecords
from nemo_rl.algorithms.single_controller_utils.stall_watchdog import StallWatchdog
from nemo_rl.algorithms.single_controller_utils.snapshot import (
    CONTROLLER_STATE_FILE,
    GymCheckpointIndex,
    RolloutSnapshotter,
    SnapshotInputs,
    required_snapshot_files,
    resolve_restorable_snapshot,
)
from nemo_rl.data.dataloader import PromptDataloader
from nemo_rl.environments.nemo_gym import GymCheckpointParked, GymReplicaLost, GymRolloutError, NemoGymShardSet
from nemo_rl.experience.data_plane import DataPlaneStore
from nemo_rl.experience.rollout_recovery import (
    PromptGroupStatus,
    RolloutAttemptStatus,
    RolloutRecoveryLedger,
    RolloutRetriesExhausted,
)
from nemo_rl.experience.rollouts import sample_from_run_reply
from nemo_rl.utils.fault_injection import crash_point
from nemo_rl.utils.loggers import MetricLoggers
from nemo_rl.utils.run_identity import record_run_identity
from nemo_rl.utils.startup_clock import StartupClock
from nemo_rl.utils.write_errors import as_write_error
from nemo_rl.utils.snapshot_store import (
    SnapshotSelection,
    anchor_dir,
    ensure_bootstrap_anchor,
    prepare_trainer_step,
    prune_trainer_steps,
    publish_trainer_step,
    resolve_restore_point,
)

logger = logging.getLogger(__name__)
# A /run Gym refuses while closed for a checkpoint is dispatched again after resume, at most this often.
MAX_REFUSALS_PER_ATTEMPT = 20
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
    ):
        self.config = config
        self.startup = startup or StartupClock(None)
        self.val_rows = list(val_rows or [])
        self.shard_set = shard_set
        self.trainer = trainer
        self.generation = generation
        self.rows = rows
        self.on_progress = on_progress or (lambda _: None)
        self.checkpoint_dir = Path(config.checkpointing.checkpoint_dir)
        self.records = RunRecords(config.logger.log_dir, config.logger.metrics_file, loggers)
        self.ledger = RolloutRecoveryLedger(config.async_rl.rollout_failure.max_infra_attempts_per_prompt)
        self.data_plane = DataPlaneStore()
        self.dataloader = PromptDataloader(rows, seed=config.data.seed, shuffle=config.data.shuffle)
        self.step = 0
        self.anchor_step = 0  # newest published trainer step; snapshots hang under it
        self.changes = LedgerChanges()
        self._rollouts: dict[str, asyncio.Task] = {}
        self.snapshot_counts = {"committed": 0, "failed": 0}
        recovery = config.rollout_recovery
        self.coordinator = (
            GymCheckpointCoordinator(
                shard_set,
                recovery.gym_prepare_timeout_s,
                "best_effort" if recovery.allow_restart_only_gym_servers else "block",
                park_grace_s=recovery.gym_park_grace_s,
            )
            if recovery.turn_checkpointing_enabled and config.checkpointing.enabled
            else None
        )
        self.snapshotter: RolloutSnapshotter | None = None  # built after restore, over the restored state
        self.watchdog = StallWatchdog(
            config.async_rl.stall_watchdog, in_flight=lambda: len(self._rollouts),
            transitions=lambda: self.changes.count, activity=self._gym_activity,
        )

    @property
    def dispatch_open(self) -> bool:
        return self.snapshotter is None or self.snapshotter.gate.is_open

    # ------------------------------------------------------------------ run
    async def run(self) -> dict[str, Any]:
        """Restore, then train; rollouts and the snapshot pump are tasks of one group owned here."""
        await self.restore_if_any()
        self.startup.mark("restore")
        if self.config.checkpointing.enabled:
            self.snapshotter = RolloutSnapshotter(
                SnapshotInputs(
                    self.ledger, self.data_plane, self.dataloader, lambda: self.step, self.anchor_dir,
                    agent_servers={iid: self.shard_set.agent_servers.get(inst.shard_name, {})
                                   for iid, inst in self.shard_set.instances.items()},
                ),
                self.coordinator, self.records, self.config.rollout_checkpointing, self.changes,
            )
        try:
            async with asyncio.TaskGroup() as tasks:
                pump = tasks.create_task(self._snapshot_pump(), name="rollout-snapshot-pump")
                watchdog = tasks.create_task(self.watchdog.run(), name="stall-watchdog")
                try:
                    await self._train(tasks)
                finally:
                    pump.cancel()
                    watchdog.cancel()
                    for rollout in list(self._rollouts.values()):
                        rollout.cancel()
        except BaseExceptionGroup as group:
            raise _first_error(group) from None
        finally:
            if self.coordinator is not None:
                await self.coordinator.aclose()
        return {"step": self.step, "trained_groups": self.ledger.trained_count,
                "trained_positions": [list(r) for r in self.ledger.trained_positions]}

    async def _train(self, tasks: asyncio.TaskGroup) -> None:
        grpo = self.config.grpo
        if grpo.val_at_start and self.step == 0 and self.val_rows:
            self.records.metrics({"step": 0, **await self._validate(tasks)})
        while self.step < self.config.grpo.max_num_steps:
            target = self.step + 1
            self._reserve_groups(target)
            t0 = time.monotonic()
            groups = await self._generate(tasks, target)
            gen_s = time.monotonic() - t0
            samples = [s for g in groups for s in self.data_plane.group_samples(g)]
            t1 = time.monotonic()
            metrics = await asyncio.to_thread(self.trainer.train_step, samples)
            crash_point("train")  # test-only: batch consumed, step not checkpointed
            train_s = time.monotonic() - t1
            for g in groups:
                self.ledger.mark_group_trained(g)
                self.data_plane.discard(s.rollout_id for s in self.data_plane.group_samples(g))
            if self.generation is not None:
                await asyncio.to_thread(self.generation.refit, self.trainer)
            self.step = target
            record = {
                "step": self.step,
                "reward_mean": sum(s.reward for s in samples) / max(1, len(samples)),
                "weight_version": self.trainer.weight_version,
                "generation_s": round(gen_s, 3),
                "training_s": round(train_s, 3),
                "groups": groups,
                "snapshots_committed": self.snapshot_counts["committed"],
                "snapshots_failed": self.snapshot_counts["failed"],
                **{k: v for k, v in metrics.items() if k not in ("step",)},
            }
            if grpo.val_period and self.step % grpo.val_period == 0 and self.val_rows:
                record.update(await self._validate(tasks))
            self.records.metrics(record)
            last = self.step == self.config.grpo.max_num_steps
            if self.config.checkpointing.enabled and (self.step % self.config.checkpointing.save_period == 0 or last):
                await self.save_trainer_checkpoint()
                await self._forget_trained()
            elif not self.config.checkpointing.enabled:
                self.anchor_step = self.step
            self.on_progress(record)

    # ------------------------------------------------------------ validation
    async def _validate(self, tasks: asyncio.TaskGroup) -> dict[str, Any]:
        """One rollout per validation row with the current weights; never trained, never snapshotted
        (it runs between steps, when no group is generating, so no snapshot is taken meanwhile)."""
        t0 = time.monotonic()
        tag = uuid.uuid4().hex[:12]
        rollout_ids = [f"val_s{self.step}_{i}_{tag}" for i in range(len(self.val_rows))]

        async def one(i: int, row: dict[str, Any]) -> float | None:
            instance = self.shard_set.pick_instance((row.get("agent_ref") or {}).get("name") or "")
            try:
                reply = await self.shard_set.handle_for(instance).run_rollout.remote(row, rollout_ids[i])
            except GymRolloutError as exc:
                if not exc.infra:
                    raise
                logger.warning("validation rollout %d failed on %s: %s", i, instance, exc)
                return None
            return float(reply["reward"])

        runs = [tasks.create_task(one(i, row), name=f"validation:{i}") for i, row in enumerate(self.val_rows)]
        rewards = [r for r in await asyncio.gather(*runs) if r is not None]
        if self.coordinator is not None:  # Gym keeps per-rollout records until told: drop the validation ones
            try:
                await self.coordinator.forget(rollout_ids)
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
    def _reserve_groups(self, target_step: int) -> None:
        """Reserve groups until ``num_prompts_per_step`` are generating for ``target_step``."""
        have = sum(1 for g in self.ledger.groups.values() if g.target_step == target_step)
        recovery = self.config.rollout_recovery
        for _ in range(self.config.grpo.num_prompts_per_step - have):
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

    async def _generate(self, tasks: asyncio.TaskGroup, target_step: int) -> list[str]:
        """Dispatch every reserved attempt while the gate is open; return when this step's groups are complete."""
        wanted = [g.group_id for g in self.ledger.groups.values() if g.target_step == target_step]

        def complete() -> bool:
            return all(self.ledger.groups[g].status is PromptGroupStatus.COMPLETE for g in wanted)

        def work() -> bool:
            return complete() or (self.dispatch_open and bool(self.ledger.reserved_attempts()))

        while True:
            if self.dispatch_open:
                for req in self.ledger.reserved_attempts():
                    self._dispatch(tasks, req)
            if complete():
                return wanted
            await self.changes.wait_for(work)

    def _dispatch(self, tasks: asyncio.TaskGroup, req) -> None:
        group = self.ledger.groups[req.group_id]
        row = self.rows[group.prompt_index]
        instance = req.gym_instance_id or self.shard_set.pick_instance(group.agent_name or "")
        self.ledger.mark_dispatched(req.rollout_id, instance)
        self.startup.mark("first_dispatch")
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
        try:
            try:
                reply = await self.shard_set.handle_for(instance).run_rollout.remote(row, rollout_id)
            except ray.exceptions.RayActorError as lost:
                raise GymReplicaLost(instance, lost, self.shard_set.placement.get(instance)) from None
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
                reason = str(getattr(exc, "cause", None) or exc)  # not Ray's traceback wrapper
                logger.warning("rollout %s failed on %s of %s (%s); retrying from the prompt", rollout_id,
                               exc.server, instance, reason)
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
        await self.changes.notify()

    # -------------------------------------------------------------- snapshots
    async def _snapshot_pump(self) -> None:
        """Every ``snapshot_attempt_interval_s`` while groups generate; an error here stops the run."""
        interval = self.config.rollout_checkpointing.snapshot_attempt_interval_s
        if self.snapshotter is None or interval is None:
            return
        while True:
            await asyncio.sleep(interval)  # the schedule, not a poll
            if not any(g.status is PromptGroupStatus.GENERATING for g in self.ledger.groups.values()):
                continue
            if self.anchor_step != self.step:
                continue  # step_N not durable yet: a snapshot would outlive its trainer state
            outcome = await self.snapshotter.attempt()
            self.snapshot_counts["committed" if outcome.committed else "failed"] += 1

    def anchor_dir(self) -> Path:
        return anchor_dir(self.checkpoint_dir, self.step)

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
    async def save_trainer_checkpoint(self) -> None:
        """Capture the step's bookkeeping here, write the trainer state and publish off the event loop."""
        step = self.step
        extra = {
            "step": step,
            "dataloader": self.dataloader.state_dict(),
            "ledger": self.ledger.state_dict(),  # trained groups as position ranges: no growing list
        }

        def write() -> None:

            tmp, final = prepare_trainer_step(self.checkpoint_dir, step)
            try:
                self.trainer.save(tmp, extra)
                publish_trainer_step(tmp, final, metadata={"step": step})
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written stays (startup would remove it too)
                raise

        try:
            await asyncio.to_thread(write)
        except OSError as exc:  # not named by the trainer (mkdir, rename): the file the OS names, else the step
            named = as_write_error(exc, None if exc.filename else self.checkpoint_dir / f"step_{step}")
            if named is exc:
                raise
            raise named from exc
        self.anchor_step = step
        # Older anchors go, but not under a snapshot that is still being persisted.
        async with (self.snapshotter.busy if self.snapshotter is not None else contextlib.nullcontext()):
            try:
                await asyncio.to_thread(prune_trainer_steps, self.checkpoint_dir,
                                        self.config.checkpointing.keep_top_k)
            except OSError as exc:  # a read-only or failing disk: name what could not be removed
                raise as_write_error(exc, None if exc.filename else self.checkpoint_dir) from exc

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
    def _load_ledger(self, state: dict[str, Any]) -> None:
        """A saved ledger, under this run's retry budget (the config may have changed since)."""
        self.ledger.load_state_dict(state)
        self.ledger.max_attempts_per_sibling = self.config.async_rl.rollout_failure.max_infra_attempts_per_prompt

    async def restore_if_any(self) -> None:
        if not self.config.checkpointing.enabled:
            return  # checkpointing.enabled=false: every start is a new run
        point = resolve_restore_point(self.checkpoint_dir)
        self.startup.resumed = point is not None and point.step > 0
        if point is None:
            ensure_bootstrap_anchor(self.checkpoint_dir, {"created": time.time()})
            record_run_identity(self.config)  # the directory now belongs to this run
            return
        from_trainer_only = self.config.rollout_checkpointing.restore_mode == "trainer_checkpoint"
        if from_trainer_only:  # the snapshots stay on disk, unread
            point = point._replace(snapshot=SnapshotSelection(None, []))
        else:
            # A turn-level run needs gym_checkpoint.json in the snapshot; one without it is skipped, not half-used.
            point = point._replace(snapshot=resolve_restorable_snapshot(
                point.anchor, required_snapshot_files(self.coordinator is not None)))
        if point.step > 0:
            extra = await asyncio.to_thread(self.trainer.load, point.anchor)
            self.startup.mark("trainer_load")
            self.step = self.anchor_step = int(extra["step"])
            self.dataloader.load_state_dict(extra["dataloader"])
            self._load_ledger(extra["ledger"])
            if self.generation is not None:
                await asyncio.to_thread(self.generation.refit, self.trainer)
        for path, why in point.snapshot.skipped:
            logger.warning("skipping rollout snapshot %s: %s", path, why)
        record: dict[str, Any] = {
            "trainer_step": point.step,
            "snapshot": None,
            "skipped_snapshots": [{"path": str(p), "reason": r} for p, r in point.snapshot.skipped],
            "restored_turn": 0,
            "restarted_from_prompt": 0,
            "kept_siblings": 0,
        }
        if point.snapshot.path is None:
            # Anything the trainer state still counts as in flight restarts from its prompt.
            summary = self.ledger.prepare_for_restart(set())
            why = ("rollout_checkpointing.restore_mode=trainer_checkpoint: rollout snapshots are not read"
                   if from_trainer_only else "no valid rollout snapshot")
            record.update(restarted_from_prompt=len(summary.restarted_from_prompt),
                          kept_siblings=len(summary.kept_siblings), snapshot_reason=why)
            print(f"Resuming from trainer checkpoint step {point.step} ({why}).", flush=True)
            self.records.restore(record)
            return
        snap = point.snapshot.path
        state = json.loads((snap / CONTROLLER_STATE_FILE).read_text())
        if int(state["step"]) != self.step:
            raise RuntimeError(f"{snap / CONTROLLER_STATE_FILE}: snapshot is for step {state['step']}, anchor is step {self.step}")
        self._load_ledger(state["ledger"])
        self.dataloader.load_state_dict(state["dataloader"])
        self.data_plane = DataPlaneStore.load(snap, state["data_plane"]["sha256"], state["data_plane"]["count"])
        restored: set[tuple[str, str, int]] = set()  # (instance, rollout id, the attempt Gym restored it as)
        restored_on: dict[str, str] = {}  # new capture key -> the replica that restored it
        if self.coordinator is not None:
            index = GymCheckpointIndex.read(snap)
            exported = index.exported()
            if exported:
                new_keys = await self.coordinator.restore(
                    f"restore-{uuid.uuid4().hex[:12]}", str(snap), exported, index.checkpoint_id
                )
                for iid, keys in new_keys.items():
                    for key in keys:
                        e = EpisodeId.from_capture_key(key)
                        restored.add((iid, e.rollout_id, e.attempt))
                        restored_on[key] = iid
        crash_point("restore")  # test-only: Gym restored, ledger not applied
        summary = self.ledger.prepare_for_restart(restored)
        self.data_plane.discard(summary.discarded_rollout_ids)
        record.update(
            snapshot=str(snap),
            restored_turn=len(summary.restored_turn),
            restarted_from_prompt=len(summary.restarted_from_prompt),
            kept_siblings=len(summary.kept_siblings),
            redone_groups=len(summary.redone_groups),
            restored_rollout_ids=summary.restored_turn,
            restored_instances={key: restored_on[key] for key in summary.restored_turn},
            restarted_rollout_ids=summary.restarted_from_prompt,
            kept_rollout_ids=summary.kept_siblings,
        )
        self.records.restore(record)
        print(
            f"Restored rollout snapshot {snap.name} at step {self.step}: {record['restored_turn']} continue at turn "
            f"level, {record['restarted_from_prompt']} restart from the prompt, {record['kept_siblings']} sealed kept.",
            flush=True,
        )
