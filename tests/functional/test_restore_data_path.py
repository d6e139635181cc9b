"""A restore reads the trainer's weights from disk twice (the restore lookup's hash, one load) and ships
them to generation once (the worker's construction; the restore's refit ships nothing), with the trainer
state restored exactly and the worker serving the step's weight version (docs/design.md §5.6).

Real pieces: a tiny Hugging Face model trained one GRPO step (with a KL reference) and saved through the
run store, the restore lookup, ``build_real`` with its real Ray generation worker (torch), and the
controller's own trainer load. Reads are counted by the kernel (``testkit/file_opens.py``: inotify's opens
of the step's files; each reader opens a whole file once). Ships are counted by the worker: its
construction plus its ``refits``.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray
import torch

from gym_patches.checkpoint.storage import FileSystemWriter
from nemo_rl.algorithms.grpo import GRPOTrainer
from nemo_rl.algorithms.single_controller import SingleController
from nemo_rl.algorithms.single_controller_utils.components import GRPOTrainerAdapter, build_real
from nemo_rl.algorithms.single_controller_utils.config import load_config
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.restore import find_restore_point
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.store import RunStore, TrainerBookkeeping
from nemo_rl.experience.sample import ModelCall, RolloutSample
from nemo_rl.models.policy import load_policy
from nemo_rl.utils.startup_clock import StartupClock
from testkit.file_opens import FileOpens, available
from tests.model_fixtures import tiny_qwen_dir

pytestmark = [pytest.mark.functional, pytest.mark.timeout(180),
              pytest.mark.skipif(available() is not None, reason=f"needs inotify: {available()}")]


def _samples(trainer: GRPOTrainer, seed: int) -> list[RolloutSample]:
    """Two prompt groups of two rollouts with different rewards (so the step moves the weights)."""
    rng = random.Random(seed)
    out = []
    for g in range(2):
        prompt = [rng.randrange(3, 300) for _ in range(4)]
        for k in range(2):
            gen = [rng.randrange(3, 300) for _ in range(5)]
            lp = trainer.policy.token_logprobs(prompt, gen).tolist()
            out.append(RolloutSample(rollout_id=f"s{seed}_g{g}_{k}", group_id=f"s{seed}_g{g}", generation_index=k,
                                     reward=float(k), calls=[ModelCall(prompt_token_ids=prompt,
                                                                       generation_token_ids=gen,
                                                                       generation_log_probs=lp,
                                                                       weight_version=trainer.weight_version)]))
    return out


def _trained_step(config, ckpt: Path) -> GRPOTrainer:
    """A trainer one step on, saved as ``step_1`` through the run store."""
    torch.manual_seed(0)
    p = config.policy
    trainer = GRPOTrainer(p.trainer_policy(), config.loss_fn, config.grpo,
                          load_policy(p.model_name, p.dtype, p.device, p.max_seq_len))
    trainer.train_step(_samples(trainer, 0))
    kept = TrainerBookkeeping(step=1, dataloader={"position": 2}, ledger={})
    RunStore(ckpt, FileSystemWriter(), keep_latest_k=1).save_step(1, kept, GRPOTrainerAdapter(trainer).save)
    return trainer


def test_a_restore_reads_the_weights_twice_and_ships_them_once(ray_cluster, tmp_path):
    torch.set_num_threads(1)
    model = tiny_qwen_dir(tmp_path / "model")
    ckpt = tmp_path / "ckpt"
    config = load_config(None, [f"policy.model_name={model}", "policy.device=cpu", "policy.max_seq_len=128",
                                "loss_fn.reference_policy_kl_penalty=0.01", f"checkpointing.checkpoint_dir={ckpt}"])
    saved = _trained_step(config, ckpt)
    step = ckpt / "step_1"
    assert saved.reference is not None and (step / "reference.pt").exists()

    with FileOpens([step]) as opens:
        lookup = find_restore_point(ckpt, turn_level=False, read_snapshots=False)  # hashes every file
        trainer, generation = build_real(config, [], 0, lookup.point, log=lambda _: None)
        try:
            controller = SimpleNamespace(trainer=trainer, generation=generation, startup=StartupClock())
            extra = asyncio.run(SingleController._load_trainer(controller, lookup.point.anchor))
            reads = opens.counts()
            worker = generation._worker
            stats = ray.get(worker.get_stats.remote())
            served = ray.get(worker.weight_version.remote())

            # the weights and every other file of the step: the hash and one load each
            for name in ("model.safetensors", "optimizer.pt", "reference.pt", "rng.pt"):
                assert reads.get(f"step_1/{name}") == 2, (name, reads)
            # shipped once: the worker's construction; the restore's refit had nothing to ship
            assert stats["refits"] == 0 and served == 1
            # the trainer state restored exactly
            inner = trainer.inner
            assert (inner.step, inner.weight_version, extra["dataloader"]) == (1, 1, {"position": 2})
            for k, v in saved.state_dict_for_refit().items():
                assert torch.equal(inner.state_dict_for_refit()[k], v), k
            for k, v in saved.reference.state_dict_cpu().items():
                assert torch.equal(inner.reference.state_dict_cpu()[k], v), k
            assert _same_optimizer(saved.optimizer.state_dict(), inner.optimizer.state_dict())
            # generation serves the restored weights: its logprobs are the trainer's
            prompt, gen = [5, 17, 42, 8], [99, 3, 250]
            theirs = ray.get(worker.logprobs.remote(prompt, gen))
            assert torch.allclose(torch.tensor(theirs), inner.policy.token_logprobs(prompt, gen), atol=1e-5)

            # a step after the restore changes the weights: that refit ships them
            trainer.train_step(_samples(inner, 1))
            generation.refit(trainer)
            assert ray.get(worker.get_stats.remote())["refits"] == 1
            assert ray.get(worker.weight_version.remote()) == 2
        finally:
            generation.stop()


def _same_optimizer(a: dict, b: dict) -> bool:
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    return all(torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i])
