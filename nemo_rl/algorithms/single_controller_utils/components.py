"""Build the trainer and the generation backend a run plugs into the controller.

``policy.model_name: scripted-test-backend`` selects a test pair (a scripted
OpenAI-compatible backend that plays each row's demonstration, and a trainer
that only records batches) for RL-level tests of recovery; anything else is
the real tiny policy trained with GRPO.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import ray

from gym_patches.utils.processes import free_port
from nemo_rl.algorithms.single_controller_utils.config import MasterConfig

logger = logging.getLogger(__name__)
SCRIPTED_TEST_BACKEND = "scripted-test-backend"


class ScriptedTestGeneration:
    """Test backend: plays each row's ground truth; refit is a no-op (it has no weights)."""

    def __init__(self, rows: list[dict[str, Any]], delay_s: float = 0.0):
        from gym_patches.testing.scripted_backend import ScriptedBackend

        self._backend = ScriptedBackend().start()
        self._backend.plans_from_rows(rows)
        # Fake tokens are bytes, so a row's max_output_tokens would cut a scripted call short.
        self._backend.configure(delay_s=delay_s, respect_max_tokens=False)
        self.base_url = self._backend.base_url

    def refit(self, trainer: Any) -> None:
        pass

    def stop(self) -> None:
        self._backend.stop()


class RayGenerationBackend:
    """The real policy served by a ``GenerationWorker`` Ray actor; refit after every step."""

    def __init__(self, config: MasterConfig, tokenizer: Any, weights: bytes, port: int):
        from nemo_rl.models.generation.worker import GenerationWorker

        gpus = 1 if config.cluster.gpus_per_node > 0 else 0
        self._worker = GenerationWorker.options(num_cpus=1, num_gpus=gpus).remote(
            config.policy.model_dump(mode="json"), tokenizer.to_dict(), weights, 0, config.grpo.seed
        )
        self.base_url = ray.get(self._worker.start.remote("127.0.0.1", port))

    def refit(self, trainer: Any) -> None:
        ray.get(self._worker.refit.remote(trainer.state_dict_bytes(), trainer.weight_version))

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

    def train_step(self, samples):
        return self.inner.train_step(samples)

    def state_dict_bytes(self) -> bytes:
        return self.inner.state_dict_bytes()

    def save(self, directory: Path, extra_state: dict[str, Any]) -> None:
        self.inner.save(directory, dataloader_state=extra_state)

    def load(self, directory: Path) -> dict[str, Any]:
        return self.inner.load(directory)


def reserve_policy_url(config: MasterConfig) -> tuple[str, int]:
    """Gym needs the policy URL before the policy exists: reserve a loopback port for it."""
    port = free_port()
    return f"http://127.0.0.1:{port}/v1", port


def build_real(config: MasterConfig, rows: list[dict[str, Any]], port: int, log=print) -> tuple[Any, Any]:
    """Tokenizer, tiny policy (+ warm start on demonstrations), GRPO trainer, generation worker."""
    import torch

    from nemo_rl.algorithms.grpo import GRPOTrainer
    from nemo_rl.algorithms.warm_start import build_tokenizer, warm_start

    torch.manual_seed(config.grpo.seed)
    tokenizer = build_tokenizer(rows)
    trainer = GRPOTrainer(config.policy, config.loss_fn, config.grpo, tokenizer)
    ws = config.policy.warm_start
    if ws.steps > 0:
        log(f"Warm start: {ws.steps} supervised steps on the rows' demonstrations...")
        metrics = warm_start(trainer.policy, tokenizer, rows, steps=ws.steps, batch_size=ws.batch_size,
                             lr=ws.learning_rate, seed=config.grpo.seed, label_smoothing=ws.label_smoothing)
        log(f"Warm start done: loss {metrics['warm_start_loss']:.3f} in {metrics['warm_start_s']:.1f}s")
    generation = RayGenerationBackend(config, tokenizer, trainer.state_dict_bytes(), port)
    return GRPOTrainerAdapter(trainer), generation
