"""What ``run_grpo`` (``nemo_rl/cli/run_grpo.py``) does once the config is loaded, in order:
Ray -> Gym spin-up and the restart-only check -> policy and generation ->
the controller loop -> plots and a summary. Everything started is stopped.
``hooks`` (``nemo_rl.utils.run_hooks``) reach the Gym setup and the controller."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import ray

from gym_patches.checkpoint.storage import build_writer
from gym_patches.utils.collector import freeze_startup_objects
from nemo_rl.algorithms.single_controller_utils.components import (
    SCRIPTED_TEST_BACKEND,
    ScriptedTestGeneration,
    build_real,
    preflight,
    reserve_policy_url,
)
from nemo_rl.algorithms.single_controller_utils.config import MasterConfig
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.restore import RestoreLookup, find_restore_point
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.store import RunStore
from nemo_rl.algorithms.single_controller_utils.setup import _spinup_gym, check_gym_configs, init_ray
from nemo_rl.data.dataloader import load_jsonl
from nemo_rl.utils.loggers import MetricLoggers, open_loggers
from nemo_rl.utils.run_hooks import RunHooks
from nemo_rl.algorithms.single_controller_utils.run_identity_check import check_run_identity
from nemo_rl.utils.run_lock import hold_run_dirs
from nemo_rl.utils.startup_clock import StartupClock
from nemo_rl.utils.stop_signals import (
    RunStopped,
    StopSignals,
    exit_status,
    shutdown_shielded_ray,
    unblock_in_child,
)
from nemo_rl.utils.write_errors import naming_write


def _warn_to_stderr(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"{category.__name__}: {message}", file=sys.stderr, flush=True)


RUN_ID_ENV = "NEMO_RL_RUN_ID"
TEARDOWN_RESERVE_S = 5.0  # of rollout_checkpointing.stop_grace_s, kept for stopping Gym, generation and Ray
# The reaper: sleeps until the kernel tells it the driver died (parent-death signal), then SIGKILLs
# every process of the run. argv: the run id, the driver pid, the driver's process group if the driver
# led it (else 0).
_REAPER_CODE = """
import os, signal, sys, time
needle = ("%s=" + sys.argv[1]).encode()
driver, group = int(sys.argv[2]), int(sys.argv[3])
def members():
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open("/proc/" + entry + "/environ", "rb") as f:
                    if needle in f.read().split(b"\\0"):
                        yield int(entry)
            except OSError:
                pass
def reap(*_):
    for _ in range(50):  # until nothing of the run is left (a starting process may appear late)
        if group:
            try:
                os.killpg(group, signal.SIGKILL)
            except OSError:
                pass
        pids = list(members())
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.2)
    os._exit(0)
def parent_death(*_):
    if os.getppid() != driver:  # the driver is gone (parent-death signal); a SIGTERM sent to every process
        reap()                  # of the run while the driver lives is the driver's to handle
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGUSR1, signal.SIG_IGN)
signal.signal(signal.SIGTERM, parent_death)
if os.getppid() != driver:  # the driver died before the parent-death signal was armed
    reap()
while True:
    time.sleep(3600)
""" % RUN_ID_ENV


class _RunReaper:
    """Takes every process of the run down if the driver dies abruptly (SIGKILL, OOM kill, crash).

    Ray's GCS and raylet die with the driver and Gym servers with their Ray
    worker, but some Ray processes outlive it for up to a minute, holding ports:
    the dashboard and runtime-env agents wait for a GCS that is gone, and workers
    that were starting (in their own sessions) wait for their raylet. The
    reaper, in its own session so that a kill of the run's process group does
    not take it along, kills every process that carries this run's
    ``NEMO_RL_RUN_ID`` (Ray workers, the generation worker, Gym servers inherit
    it) and, when the driver leads its own process group (a shell job, or
    ``start_new_session``), that group (Ray's agents are in it but do not get
    the variable). A normal exit disarms it first.
    """

    def __init__(self, proc: subprocess.Popen | None):
        self.proc = proc

    @classmethod
    def start(cls) -> "_RunReaper":
        os.environ[RUN_ID_ENV] = uuid.uuid4().hex
        if not sys.platform.startswith("linux"):
            return cls(None)
        group = os.getpgid(0) if os.getpgid(0) == os.getpid() else 0

        def arm() -> None:
            import ctypes

            unblock_in_child()  # the run blocks its stop signals in children; the reaper needs SIGTERM
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

        proc = subprocess.Popen(
            [sys.executable, "-c", _REAPER_CODE, os.environ[RUN_ID_ENV], str(os.getpid()), str(group)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=arm, start_new_session=True,
        )
        return cls(proc)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # SIGKILL: the reaper must not reap on a normal exit
            self.proc.wait()


def run(config: MasterConfig, *, launched_at: float | None = None, hooks: RunHooks | None = None) -> int:
    """The run directories stay locked until this returns: a second launch on them is refused at once."""
    launched_at = launched_at or time.monotonic()
    hooks = hooks or RunHooks()
    check_gym_configs(config)  # a bad Gym key fails in a second, before anything is written or started
    ckpt = config.checkpointing
    # Entered before any child starts: each inherits the blocked stop signals (docs/design.md §5.11).
    with StopSignals(config.rollout_checkpointing.stop_grace_s) as stops:
        try:
            with hold_run_dirs(config.logger.log_dir, ckpt.checkpoint_dir if ckpt.enabled else None):
                return _run_locked(config, launched_at, hooks, stops)
        except RunStopped as stopped:  # everything started is stopped by now
            print(stopped.line(), flush=True)
            return exit_status(signal.Signals[stopped.by])
        except KeyboardInterrupt:  # a stop while starting up or wrapping up (no controller loop to take it)
            if stops.first is None:
                raise
            print(f"stopped by {stops.name} outside the training loop (while starting or finishing): no "
                  "rollout was in flight; run the same command to continue", flush=True)
            return exit_status(stops.first)


def _run_locked(config: MasterConfig, launched_at: float, hooks: RunHooks, stops: StopSignals) -> int:
    check_run_identity(config)  # another run's checkpoint_dir is refused before anything starts
    lookup = RestoreLookup(None)
    # The one owner of checkpoint_dir, with this process's writer (each Gym server builds its own).
    store = RunStore(config.checkpointing.checkpoint_dir, build_writer(config.checkpointing.storage_writer),
                     keep_latest_k=config.rollout_checkpointing.keep_latest_k)
    if config.checkpointing.enabled:
        store.remove_stale_tmp_dirs()  # only this process writes here now
        # The one lookup of what this start restores (the chosen trainer step is hashed once, here).
        lookup = find_restore_point(
            store.checkpoint_dir,
            turn_level=config.rollout_recovery.turn_checkpointing_enabled,
            read_snapshots=config.rollout_checkpointing.restore_mode != "trainer_checkpoint")
    finished = preflight(config, lookup.point)  # an unfetchable policy.model_name fails here too, in seconds
    if finished:
        print(finished, flush=True)
        return 0
    warnings.showwarning = _warn_to_stderr
    log_dir = Path(config.logger.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    startup = StartupClock(log_dir)
    startup.mark("config")
    with naming_write(log_dir / "config.yaml"):
        (log_dir / "config.yaml").write_text(config.to_yaml())
    rows = load_jsonl(config.data.train_data_path)
    wants_val = config.grpo.val_period > 0 or config.grpo.val_at_start
    val_rows = load_jsonl(config.data.val_data_path)[: config.grpo.max_val_samples] if wants_val else []
    scripted = config.policy.model_name == SCRIPTED_TEST_BACKEND

    reaper = _RunReaper.start()
    try:
        # Started before Ray: a backend that cannot start (not installed, a bad tracking uri) fails in
        # seconds naming its key; after the reaper, so a W&B service process is one of the run's own.
        # Closed on every way out, so the last rows reach the backends when the run fails too.
        with open_loggers(config.logger, config.to_dict()) as loggers:
            summary = _run(config, launched_at, log_dir, rows, val_rows, scripted, hooks, startup, loggers, lookup,
                           store, stops)
    finally:
        reaper.stop()
    _report(config, summary, launched_at)
    return 0


def _run(config: MasterConfig, launched_at: float, log_dir: Path, rows: list[dict[str, Any]],
         val_rows: list[dict[str, Any]], scripted: bool, hooks: RunHooks,
         startup: StartupClock, loggers: MetricLoggers, lookup: RestoreLookup, store: RunStore,
         stops: StopSignals) -> dict[str, Any]:
    init_ray(config)
    startup.mark("ray")
    generation = None
    shard_set = None
    port_hold = None
    try:
        if scripted:
            replies = config.policy.scripted_backend
            generation = ScriptedTestGeneration(rows + val_rows, delay_s=replies.delay_s, jitter_s=replies.jitter_s,
                                                tokens_per_s=replies.tokens_per_s, max_num_seqs=replies.max_num_seqs)
            policy_url, port = generation.base_url, 0
        else:
            policy_url, port_hold = reserve_policy_url(config)
            port = port_hold.port
        shard_set = _spinup_gym(
            config, policy_base_url=policy_url, log_dir=log_dir, rows=rows, hooks=hooks,
        )
        startup.mark("gym")
        print(f"Gym ready in {time.monotonic() - launched_at:.1f}s: "
              f"{sum(len(h) for h in shard_set.handles.values())} replica(s)", flush=True)
        if scripted:
            from nemo_rl.algorithms.recording_trainer import RecordingTrainer, SimulatedTrainer

            stand_in = config.policy.simulated_trainer.seconds_per_sample
            trainer = RecordingTrainer(log_dir) if stand_in is None else SimulatedTrainer(log_dir, stand_in)
        else:
            trainer, generation = build_real(config, rows, port, lookup.point, port_hold=port_hold)
        startup.mark("model")
        freeze_startup_objects()  # imports, config and the model stay out of every later full collection
        summary = asyncio.run(_run_controller(config, shard_set, trainer, generation, rows, val_rows, startup,
                                              loggers, hooks, lookup, store, stops))
    finally:
        stops.interruptible = False  # a stop from here on waits for the teardown (within the grace)
        if port_hold is not None:
            port_hold.release()  # a run that failed before its worker served the port
        if shard_set is not None:
            shard_set.shutdown()
        if generation is not None:
            generation.stop()
        shutdown_shielded_ray()  # Ray's processes ignore the SIGTERM of a graceful ray.shutdown()
    return summary


async def _run_controller(config, shard_set, trainer, generation, rows, val_rows, startup,
                          loggers, hooks, lookup, store: RunStore, stops: StopSignals) -> dict[str, Any]:
    from nemo_rl.algorithms.single_controller import SingleController
    from nemo_rl.utils.progress import StepProgress

    with StepProgress(total=config.grpo.max_num_steps, enabled=config.logger.progress_bar) as progress:
        controller = SingleController(config, shard_set, trainer, generation, rows, val_rows=val_rows,
                                      on_progress=progress.update, startup=startup, loggers=loggers,
                                      hooks=hooks, restore_lookup=lookup, store=store)
        # The final snapshot gets the grace less what tearing the run down takes.
        controller.stop_budget_s = lambda: max(1.0, stops.remaining_s() - TEARDOWN_RESERVE_S)
        stops.attach(asyncio.get_running_loop(), controller.request_stop, controller.request_snapshot)
        try:
            summary = await controller.run()
        finally:
            stops.detach()
    return summary


def _report(config: MasterConfig, summary: dict[str, Any], launched_at: float) -> None:
    from nemo_rl.utils.plots import no_reward_signal, plot_run, summary_table

    log_dir = Path(config.logger.log_dir)
    metrics_path = log_dir / config.logger.metrics_file
    metrics = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()] \
        if metrics_path.exists() else []
    if config.logger.plot and metrics:
        path = plot_run(metrics, log_dir / "reward_curve.png")
        print(f"Reward curve: {path}")
    ckpt = config.checkpointing
    print(summary_table(metrics, log_dir, wall_s=time.monotonic() - launched_at,
                        checkpoint_dir=ckpt.checkpoint_dir if ckpt.enabled else None), flush=True)
    if no_reward_signal(metrics):
        print("warning: no step had any reward signal (every prompt group's rollouts got the same reward, so "
              "every advantage, loss and gradient was 0): nothing was learned. Check the rewards in "
              f"{log_dir / config.logger.metrics_file} (reward_mean, reward_std); a larger "
              "grpo.num_generations_per_prompt or a policy that sometimes succeeds gives GRPO a signal.",
              file=sys.stderr, flush=True)
