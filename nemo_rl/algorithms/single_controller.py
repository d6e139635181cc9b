"""The single controller: prompts in, trained steps out, rollouts snapshotted on the way.

Read top to bottom: ``run`` restores (if a checkpoint exists), then for each
step reserves prompt groups, dispatches their rollouts to Gym, seals what
comes back, trains on complete groups, refits generation and saves a trainer
checkpoint. A background pump takes rollout snapshots meanwhile (DESIGN §4.4);
restore follows DESIGN §4.5.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import ray

from gym_patches.checkpoint.identity import EpisodeId
from nemo_rl.algorithms.single_controller_utils.config import MasterConfig
from nemo_rl.algorithms.single_controller_utils.gym_coordinator import GymCheckpointCoordinator
from nemo_rl.algorithms.single_controller_utils.interfaces import GenerationBackend, Trainer
from nemo_rl.algorithms.single_controller_utils.run_records import RunRecords
from nemo_rl.algorithms.single_controller_utils.snapshot import (
    CONTROLLER_STATE_FILE,
    GYM_CHECKPOINT_FILE,
    RolloutSnapshotter,
    required_snapshot_files,
    resolve_restorable_snapshot,
)
from nemo_rl.data.dataloader import PromptDataloader
from nemo_rl.environments.nemo_gym import GymCheckpointParked, GymRolloutError, NemoGymShardSet
from nemo_rl.experience.data_plane import DataPlaneStore
from nemo_rl.experience.rollout_recovery import (
    PromptGroupStatus,
    RolloutAttemptStatus,
    RolloutRecoveryLedger,
)
from nemo_rl.experience.rollouts import sample_from_run_reply
from nemo_rl.utils.fault_injection import crash_point
from nemo_rl.utils.snapshot_store import (
    anchor_dir,
    ensure_bootstrap_anchor,
    prepare_trainer_step,
    publish_trainer_step,
    remove_stale_tmp_dirs,
    resolve_restore_point,
    write_json_atomic,
)

logger = logging.getLogger(__name__)


class SingleController:
    def __init__(
        self,
        config: MasterConfig,
        shard_set: NemoGymShardSet,
        trainer: Trainer,
        generation: GenerationBackend | None,
        rows: list[dict[str, Any]],
        *,
        on_progress: Callable[[dict[str, Any]], None] | None = None,
    ):
        self.config = config
        self.shard_set = shard_set
        self.trainer = trainer
        self.generation = generation
        self.rows = rows
        self.on_progress = on_progress or (lambda _: None)
        self.checkpoint_dir = Path(config.checkpointing.checkpoint_dir)
        self.records = RunRecords(config.logger.log_dir)
        self.ledger = RolloutRecoveryLedger()
        self.data_plane = DataPlaneStore()
        self.dataloader = PromptDataloader(rows, seed=config.data.seed, shuffle=config.data.shuffle)
        self.step = 0
        self.anchor_step = 0  # newest published trainer step; snapshots hang under it
        self.dispatch_open = asyncio.Event()
        self.dispatch_open.set()
        # Rollouts RL dispatched that Gym refused (parked): not in Gym, re-sent after resume.
        self.not_in_gym: set[str] = set()
        self.pending_retirements: dict[str, list[EpisodeId]] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._group_seq = 0
        self.snapshot_counts = {"committed": 0, "failed": 0}
        recovery = config.rollout_recovery
        self.coordinator = (
            GymCheckpointCoordinator(
                shard_set,
                recovery.gym_prepare_timeout_s,
                "best_effort" if recovery.allow_restart_only_gym_servers else "block",
            )
            if recovery.turn_checkpointing_enabled
            else None
        )
        self.snapshotter = RolloutSnapshotter(self) if self.coordinator else None
        self._fatal: BaseException | None = None

    # ------------------------------------------------------------------ run
    async def run(self) -> dict[str, Any]:
        await self.restore_if_any()
        pump = asyncio.create_task(self._snapshot_pump(), name="rollout-snapshot-pump")
        try:
            while self.step < self.config.grpo.max_num_steps:
                target = self.step + 1
                self._reserve_groups(target)
                t0 = time.monotonic()
                groups = await self._generate(target)
                gen_s = time.monotonic() - t0
                samples = [s for g in groups for s in self.data_plane.group_samples(g)]
                t1 = time.monotonic()
                metrics = self.trainer.train_step(samples)
                crash_point("train")  # test-only: batch consumed, step not checkpointed
                train_s = time.monotonic() - t1
                for g in groups:
                    self.ledger.mark_group_trained(g)
                    self.data_plane.discard(s.rollout_id for s in self.data_plane.group_samples(g))
                if self.generation is not None:
                    self.generation.refit(self.trainer)
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
                self.records.metrics(record)
                if self.step % self.config.checkpointing.save_period == 0 or self.step == self.config.grpo.max_num_steps:
                    self.save_trainer_checkpoint()
                self.on_progress(record)
        finally:
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)
            await self._cancel_rollouts()
        return {"step": self.step, "trained_groups": list(self.ledger.trained_group_ids)}

    # ------------------------------------------------------------ generation
    def _reserve_groups(self, target_step: int) -> None:
        """Reserve groups until ``num_prompts_per_step`` are generating for ``target_step``."""
        have = sum(1 for g in self.ledger.groups.values() if g.target_step == target_step)
        recovery = self.config.rollout_recovery
        for _ in range(self.config.grpo.num_prompts_per_step - have):
            index = self.dataloader.next_index()
            row = self.rows[index]
            agent = (row.get("agent_ref") or {}).get("name")
            task_source = row.get("task_source")
            group_id = f"s{target_step}p{self.dataloader.position - 1}"
            self.ledger.reserve_group(
                group_id=group_id,
                prompt_id=str(row.get("id", index)),
                prompt_index=index,
                task_source=task_source,
                agent_name=agent,
                restore_level=recovery.resolve_for(task_source, agent),
                num_generations=self.config.grpo.num_generations_per_prompt,
                target_step=target_step,
            )

    async def _generate(self, target_step: int) -> list[str]:
        """Dispatch every reserved attempt; return when this step's groups are complete."""
        wanted = [g.group_id for g in self.ledger.groups.values() if g.target_step == target_step]
        while True:
            if self._fatal is not None:
                raise self._fatal
            await self.dispatch_open.wait()
            for req in self.ledger.reserved_attempts():
                if not self.dispatch_open.is_set():
                    break
                self._dispatch(req)
            if all(self.ledger.groups[g].status is PromptGroupStatus.COMPLETE for g in wanted):
                return wanted
            await asyncio.sleep(0.02)

    def _dispatch(self, req) -> None:
        group = self.ledger.groups[req.group_id]
        row = self.rows[group.prompt_index]
        instance = req.gym_instance_id or self.shard_set.pick_instance(group.agent_name or "")
        self.ledger.mark_dispatched(req.rollout_id, instance)
        self._tasks[req.rollout_id] = asyncio.create_task(
            self._run_rollout(req.rollout_id, req.group_id, req.generation_index, instance, row),
            name=f"rollout:{req.rollout_id}",
        )

    async def _run_rollout(self, rollout_id: str, group_id: str, g: int, instance: str, row: dict) -> None:
        handle = self.shard_set.handle_for(instance)
        try:
            while True:
                try:
                    reply = await handle.run_rollout.remote(row, rollout_id)
                    break
                except GymCheckpointParked:
                    # Refused while a checkpoint held the agent closed: not in Gym; send again after resume.
                    self.not_in_gym.add(rollout_id)
                    await asyncio.sleep(0.05)
                    await self.dispatch_open.wait()
                    self.not_in_gym.discard(rollout_id)
            if self.ledger_status(rollout_id) is not RolloutAttemptStatus.DISPATCHED:
                return  # dropped meanwhile (e.g. retired)
            sample = sample_from_run_reply(
                reply, rollout_id=rollout_id, group_id=group_id, generation_index=g,
                prompt_id=self.ledger.groups[group_id].prompt_id, gym_instance_id=instance,
            )
            self.data_plane.put(sample)
            self.ledger.mark_sealed(rollout_id, sample.reward)
        except GymRolloutError as exc:
            if exc.code == "stale_attempt":
                return
            if not exc.infra:
                self._fatal = exc
                return
            reason = str(getattr(exc, "cause", None) or exc)  # not Ray's traceback wrapper
            logger.warning("rollout %s failed on %s (%s); retrying from the prompt", rollout_id, exc.server, reason)
            try:
                self.ledger.mark_failed(rollout_id)
            except Exception as fatal:  # retries exhausted: stop the run, naming the server
                self._fatal = RuntimeError(
                    f"Gym server {exc.server!r} on {instance} keeps failing: {fatal}; last error: {reason}"
                )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - surfaced to the main loop, never swallowed
            self._fatal = exc
        finally:
            self._tasks.pop(rollout_id, None)

    def ledger_status(self, rollout_id: str) -> RolloutAttemptStatus | None:
        return self.ledger.attempt_status(rollout_id)

    async def _cancel_rollouts(self) -> None:
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -------------------------------------------------------------- snapshots
    async def _snapshot_pump(self) -> None:
        interval = self.config.rollout_checkpointing.snapshot_attempt_interval_s
        if self.snapshotter is None or interval is None:
            return
        while True:
            await asyncio.sleep(interval)
            if not any(g.status is PromptGroupStatus.GENERATING for g in self.ledger.groups.values()):
                continue
            if self.anchor_step != self.step:
                continue  # step_N not durable yet: a snapshot would outlive its trainer state
            try:
                outcome = await self.snapshotter.attempt()
            except BaseException as exc:
                if not isinstance(exc, asyncio.CancelledError):
                    self._fatal = exc
                raise
            self.snapshot_counts["committed" if outcome.committed else "failed"] += 1

    def anchor_dir(self) -> Path:
        return anchor_dir(self.checkpoint_dir, self.step)

    def write_controller_state(self, directory: Path) -> None:
        """Ledger, data plane and dataloader position, as one consistent cut."""
        dp = self.data_plane.save(directory)
        write_json_atomic(
            directory / CONTROLLER_STATE_FILE,
            {
                "step": self.step,
                "ledger": self.ledger.state_dict(),
                "dataloader": self.dataloader.state_dict(),
                "data_plane": dp,
            },
        )

    # ------------------------------------------------------- trainer checkpoints
    def save_trainer_checkpoint(self) -> None:
        tmp, final = prepare_trainer_step(self.checkpoint_dir, self.step)
        self.trainer.save(
            tmp,
            {
                "step": self.step,
                "dataloader": self.dataloader.state_dict(),
                "trained_group_ids": list(self.ledger.trained_group_ids),
                "ledger": self.ledger.state_dict(),
            },
        )
        publish_trainer_step(tmp, final, metadata={"step": self.step})
        self.anchor_step = self.step

    # ---------------------------------------------------------------- restore
    async def restore_if_any(self) -> None:
        removed = remove_stale_tmp_dirs(self.checkpoint_dir)
        for path in removed:
            logger.warning("removed a half-written checkpoint directory left by a crash: %s", path)
        point = resolve_restore_point(self.checkpoint_dir)
        if point is None:
            ensure_bootstrap_anchor(self.checkpoint_dir, {"created": time.time()})
            return
        # A turn-level run needs gym_checkpoint.json in the snapshot; one without it is skipped, not half-used.
        point = point._replace(snapshot=resolve_restorable_snapshot(
            point.anchor, required_snapshot_files(self.coordinator is not None)))
        if point.step > 0:
            extra = self.trainer.load(point.anchor)
            self.step = self.anchor_step = int(extra["step"])
            self.dataloader.load_state_dict(extra["dataloader"])
            self.ledger.load_state_dict(extra["ledger"])
            if self.generation is not None:
                self.generation.refit(self.trainer)
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
            record.update(restarted_from_prompt=len(summary.restarted_from_prompt),
                          kept_siblings=len(summary.kept_siblings))
            print(f"Resuming from trainer checkpoint step {point.step} (no valid rollout snapshot).", flush=True)
            self.records.restore(record)
            return
        snap = point.snapshot.path
        state = json.loads((snap / CONTROLLER_STATE_FILE).read_text())
        if int(state["step"]) != self.step:
            raise RuntimeError(f"{snap / CONTROLLER_STATE_FILE}: snapshot is for step {state['step']}, anchor is step {self.step}")
        self.ledger.load_state_dict(state["ledger"])
        self.dataloader.load_state_dict(state["dataloader"])
        self.data_plane = DataPlaneStore.load(snap, state["data_plane"]["sha256"], state["data_plane"]["count"])
        restored: set[tuple[str, str, int]] = set()
        restored_on: dict[str, str] = {}  # new capture key -> the replica that restored it
        gym_file = snap / GYM_CHECKPOINT_FILE
        if self.coordinator is not None:
            gym = json.loads(gym_file.read_text())
            exported = {iid: by_server for iid, by_server in gym["instances"].items() if any(by_server.values())}
            if exported:
                new_keys = await self.coordinator.restore(
                    f"restore-{uuid.uuid4().hex[:12]}", str(snap), exported, gym["checkpoint_id"]
                )
                for iid, keys in new_keys.items():
                    for key in keys:
                        e = EpisodeId.from_capture_key(key)
                        restored.add((iid, e.rollout_id, e.attempt - 1))
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
