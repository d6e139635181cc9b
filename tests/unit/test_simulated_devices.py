"""The simulated devices take the wall time they are configured for (lower bounds, never a timing goal):
the scripted backend's generation stand-in (``policy.scripted_backend.tokens_per_s``, a real backend
process over HTTP) and ``SimulatedTrainer`` (``policy.simulated_trainer.seconds_per_sample``), and their
keys are refused without the scripted backend."""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gym_patches.fakes.scripted_backend import ScriptedBackend
from nemo_rl.algorithms.recording_trainer import RecordingTrainer, SimulatedTrainer
from nemo_rl.algorithms.single_controller_utils.components import ScriptedTestGeneration
from nemo_rl.algorithms.single_controller_utils.config import ConfigError, load_config
from nemo_rl.experience.sample import ModelCall, RolloutSample

REPLY = "a" * 60  # 60 fake tokens (bytes)


def _chat(base_url: str, user: str) -> tuple[float, int, float, float]:
    """Seconds until the reply came back, its completion tokens, and when it was sent and came back."""
    body = json.dumps({"messages": [{"role": "user", "content": user}]}).encode()
    req = urllib.request.Request(f"{base_url}/chat/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=30) as resp:
        reply = json.loads(resp.read())
    t1 = time.monotonic()
    return t1 - t0, int(reply["usage"]["completion_tokens"]), t0, t1


def test_a_reply_of_k_tokens_is_not_back_before_k_over_the_rate_and_replies_in_flight_share_it():
    rate = 300.0
    with ScriptedBackend() as backend:
        backend.set_plans({"q": [{"content": REPLY}]})
        assert backend.configure(tokens_per_s=rate)["tokens_per_s"] == rate
        took, k, _, _ = _chat(backend.base_url, "q")
        assert k == len(REPLY) and took >= k / rate
        # Four at once share the device: from the first sent to the last back, it decoded all four replies.
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda _: _chat(backend.base_url, "q"), range(4)))
        span = max(r[3] for r in results) - min(r[2] for r in results)
        assert span >= sum(r[1] for r in results) / rate
        assert backend.configure(tokens_per_s=0.0)["tokens_per_s"] == 0.0  # 0 turns the stand-in off
        assert _chat(backend.base_url, "q")[1] == k


def test_the_generation_backend_passes_the_rate_to_the_fake():
    row = {"id": "r0", "responses_create_params": {"input": [{"role": "user", "content": "q"}]},
           "final_answer": REPLY}
    generation = ScriptedTestGeneration([row], tokens_per_s=250.0)
    try:
        took, k, _, _ = _chat(generation.base_url, "q")
        assert k == len(REPLY) and took >= k / 250.0
    finally:
        generation.stop()


def _group(group: str, n: int) -> list[RolloutSample]:
    call = ModelCall(prompt_token_ids=[1, 2], generation_token_ids=[3], generation_log_probs=[-0.5])
    return [RolloutSample(rollout_id=f"{group}-{i}", group_id=group, generation_index=i, reward=float(i % 2),
                          calls=[call]) for i in range(n)]


def test_the_trainer_stand_in_sleeps_per_sample_and_records_like_the_recording_trainer(tmp_path: Path):
    per_sample = 0.05
    stand_in, plain = SimulatedTrainer(tmp_path / "sim", per_sample), RecordingTrainer(tmp_path / "plain")
    t0 = time.monotonic()
    stand_in.train_step(_group("g0", 4))
    assert time.monotonic() - t0 >= 4 * per_sample
    step = stand_in.open_step()  # streaming: the time is spent in each add
    t0 = time.monotonic()
    step.add(_group("g1", 3))
    assert time.monotonic() - t0 >= 3 * per_sample
    step.add(_group("g2", 2))
    metrics = step.finish()
    assert time.monotonic() - t0 >= 5 * per_sample
    plain.train_step(_group("g0", 4))
    plain.train_step(_group("g1", 3) + _group("g2", 2))
    assert metrics["num_samples"] == 5.0 and stand_in.weight_version == plain.weight_version == 2
    assert stand_in.batches == plain.batches
    assert (tmp_path / "sim" / "trained_batches.jsonl").read_text() == \
        (tmp_path / "plain" / "trained_batches.jsonl").read_text()
    with pytest.raises(ValueError, match="policy.simulated_trainer.seconds_per_sample"):
        SimulatedTrainer(tmp_path / "bad", 0.0)


@pytest.mark.parametrize("key", ["policy.simulated_trainer.seconds_per_sample=0.1",
                                 "policy.scripted_backend.tokens_per_s=100"])
def test_the_stand_ins_need_the_scripted_backend(key: str):
    with pytest.raises(ConfigError, match=rf"policy\.{key.split('.')[1]} is set but policy.model_name="):
        load_config(None, [key])
    config = load_config(None, ["policy.model_name=scripted-test-backend", key])
    assert "simulated_trainer" not in config.policy.trainer_policy().model_dump()
    with pytest.raises(ConfigError, match=r"policy\.simulated_trainer\.seconds_per_sample"):
        load_config(None, ["policy.model_name=scripted-test-backend", "policy.simulated_trainer.seconds_per_sample=0"])
