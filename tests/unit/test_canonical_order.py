"""The trainer's step in deterministic mode (``grpo.deterministic``) depends on the set of samples, not the
order they arrive in: it takes them in one canonical order (group position, then sibling index), so the
weights after the step are equal bit for bit and the step's record (``last_trace``) is the same list.
Real tiny Hugging Face model, real AdamW, multi-call rollouts with rewards that give every group signal."""

from __future__ import annotations

import random

import pytest
import torch

from nemo_rl.algorithms.grpo import GRPOTrainer
from nemo_rl.algorithms.grpo_config import GRPOConfig, LossConfig, PolicyConfig
from nemo_rl.algorithms.single_controller_utils.config import ConfigError, load_config
from nemo_rl.experience.sample import ModelCall, RolloutSample
from nemo_rl.models.policy import load_policy
from nemo_rl.parity.trace import canonical_order, group_position, trace_of_step
from tests.model_fixtures import tiny_qwen_dir

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_qwen_dir(tmp_path_factory.mktemp("tiny_canonical"))


def _trainer(model_dir, deterministic: bool) -> GRPOTrainer:
    torch.manual_seed(0)
    cfg = PolicyConfig(device="cpu", max_seq_len=128, learning_rate=1e-2, train_micro_batch_size=3)
    policy = load_policy(str(model_dir), "float32", "cpu", cfg.max_seq_len)
    return GRPOTrainer(cfg, LossConfig(reference_policy_kl_penalty=0.05), GRPOConfig(deterministic=deterministic),
                       policy)


def _samples(seed: int = 3, groups: int = 4, per_group: int = 3) -> list[RolloutSample]:
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(3, 300) for _ in range(4)]
        for k in range(per_group):
            calls = []
            for ci in range(1 + (k + g) % 2):
                p = prompt + [rng.randrange(3, 300) for _ in range(3 * ci)]
                gen = [rng.randrange(3, 300) for _ in range(rng.randint(2, 9))]
                calls.append(ModelCall(prompt_token_ids=p, generation_token_ids=gen,
                                       generation_log_probs=[-rng.random() for _ in gen]))
            out.append(RolloutSample(rollout_id=f"s1p{10 - g}_g{k}_a{seed:x}{k:x}", group_id=f"s1p{10 - g}",
                                     generation_index=k, reward=float(k == g % per_group) + 0.1 * k, calls=calls))
    return out


def _weights(trainer: GRPOTrainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.policy.model.state_dict().items()}


def test_canonical_order_is_by_position_then_sibling():
    samples = _samples()
    ordered = canonical_order(reversed(samples))
    assert [(s.group_id, s.generation_index) for s in ordered][:4] == [
        ("s1p7", 0), ("s1p7", 1), ("s1p7", 2), ("s1p8", 0)]  # p7 < p8 < p9 < p10: numbers, not strings
    assert group_position("s12p345") == 345 and group_position("other") is None


def test_a_deterministic_step_is_the_same_whatever_order_its_samples_came_in(model_dir):
    samples = _samples()
    shuffled = list(samples)
    random.Random(7).shuffle(shuffled)
    runs = []
    for order in (samples, shuffled, list(reversed(samples))):
        trainer = _trainer(model_dir, deterministic=True)
        metrics = trainer.train_step(order)
        runs.append((metrics, _weights(trainer), trainer.last_trace))
    (m0, w0, t0), rest = runs[0], runs[1:]
    assert m0["groups_with_signal"] == 4 and m0["grad_norm"] > 0
    for metrics, weights, trace in rest:
        assert all(torch.equal(w0[k], weights[k]) for k in w0)  # bit for bit
        assert trace == t0
        assert {k: v for k, v in metrics.items() if k != "train_s"} == {k: v for k, v in m0.items() if k != "train_s"}
    assert [(s.group_id, s.sibling) for s in t0] == [(s.group_id, s.generation_index) for s in canonical_order(samples)]
    assert all(s.advantage is not None for s in t0)


def test_without_the_mode_the_trainer_keeps_the_order_it_was_given(model_dir):
    samples = _samples()
    trainer = _trainer(model_dir, deterministic=False)
    trainer.train_step(list(reversed(samples)))
    assert trainer.last_trace is None
    # the recording of a trainer that keeps none: canonical order with GRPO's advantages
    fallback = trace_of_step(object(), list(reversed(samples)), normalize_rewards=True)
    assert [(s.group_id, s.sibling) for s in fallback] == [(s.group_id, s.generation_index)
                                                           for s in canonical_order(samples)]


def test_deterministic_mode_refuses_streaming_train_naming_both_keys():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["grpo.deterministic=true", "async_rl.min_groups_for_streaming_train=2"])
    assert "grpo.deterministic" in str(err.value) and "async_rl.min_groups_for_streaming_train" in str(err.value)
    load_config(None, ["grpo.deterministic=true"])  # alone: fine
