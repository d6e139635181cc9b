"""The generation worker as a real Ray actor behind real HTTP, refit by a real GRPO step."""

import asyncio
import json
import os
from pathlib import Path

import aiohttp
import pytest
import ray
import torch

from nemo_rl.algorithms.grpo import GRPOTrainer
from nemo_rl.algorithms.grpo_config import GenerationConfig, GRPOConfig, LossConfig, PolicyConfig
from nemo_rl.experience.sample import ModelCall, RolloutSample
from nemo_rl.models.chat_format import render_messages
from nemo_rl.models.generation.worker import GenerationWorker
from nemo_rl.models.tokenizer import Tokenizer

pytestmark = [pytest.mark.functional, pytest.mark.timeout(120)]
REPO = Path(__file__).resolve().parents[2]

MESSAGES = [
    {"role": "system", "content": "You are an office assistant."},
    {"role": "user", "content": "Invite bo to a meeting called sync on 2023-12-04 at 10:00"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "directory_find_email", "arguments": '{"name": "bo"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "bo@corp.com"},
]
TOOLS = [{"type": "function", "function": {"name": "directory_find_email", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def setup(ray_cluster):
    torch.set_num_threads(1)
    tok = Tokenizer.from_corpus([json.dumps(MESSAGES), "Done. calendar_create_event"])
    cfg = PolicyConfig(device="cpu", hidden_size=64, num_heads=4, num_layers=2, max_seq_len=256, learning_rate=1e-2,
                       generation=GenerationConfig(temperature=1.0, max_new_tokens=24))
    trainer = GRPOTrainer(cfg, LossConfig(), GRPOConfig(seed=0), tok)
    worker = GenerationWorker.options(num_cpus=1).remote(
        cfg.model_dump(), tok.to_dict(), trainer.state_dict_for_refit(), trainer.weight_version, 0, "tiny")
    base_url = ray.get(worker.start.remote())
    yield tok, cfg, trainer, worker, base_url
    ray.get(worker.stop.remote())
    ray.kill(worker)


async def _post(session, url, body):
    async with session.post(url, json=body) as r:
        return r.status, await r.json()


async def test_chat_completion_with_tool_history(setup):
    tok, cfg, trainer, worker, base_url = setup
    assert base_url.startswith("http://127.0.0.1:") and base_url.endswith("/v1")
    async with aiohttp.ClientSession() as s:
        async with s.get(base_url + "/models") as r:
            assert r.status == 200 and (await r.json())["data"][0]["id"] == "tiny"
        body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "temperature": 1.0, "max_tokens": 16,
                "tool_choice": "auto", "parallel_tool_calls": False}
        status, out = await _post(s, base_url + "/chat/completions", body)
    assert status == 200, out
    assert out["object"] == "chat.completion" and out["weight_version"] == 0
    assert out["prompt_token_ids"] == render_messages(tok, MESSAGES)
    gen, lps = out["generation_token_ids"], out["generation_log_probs"]
    assert 1 <= len(gen) <= 16 and len(lps) == len(gen)
    choice = out["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length", "tool_calls")
    assert choice["finish_reason"] == "length" or gen[-1] == tok.end_id
    assert [c["logprob"] for c in choice["logprobs"]["content"]] == lps
    assert out["usage"] == {"prompt_tokens": len(out["prompt_token_ids"]), "completion_tokens": len(gen),
                            "total_tokens": len(out["prompt_token_ids"]) + len(gen)}
    # the logprobs are the worker's policy's, and the trainer holds the same weights
    recomputed = trainer.policy.token_logprobs(out["prompt_token_ids"], gen, temperature=1.0)
    assert torch.allclose(recomputed, torch.tensor(lps), atol=1e-4)
    assert ray.get(worker.logprobs.remote(out["prompt_token_ids"], gen)) == pytest.approx(lps, abs=1e-4)


async def test_concurrent_requests_are_all_served(setup):
    tok, cfg, trainer, worker, base_url = setup
    body = {"messages": MESSAGES[:2], "max_tokens": 8}
    async with aiohttp.ClientSession() as s:
        results = await asyncio.gather(*[_post(s, base_url + "/chat/completions", body) for _ in range(12)])
    assert all(status == 200 for status, _ in results)
    assert all(1 <= len(o["generation_token_ids"]) <= 8 for _, o in results)
    stats = ray.get(worker.get_stats.remote())
    assert stats["batches"] < stats["requests"]  # concurrent requests shared decode batches


@pytest.mark.parametrize(
    "body, field",
    [
        ({"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
        ({"messages": MESSAGES, "temperature": -1}, "temperature"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": []}, "messages"),
        ({"max_tokens": 3}, "messages"),
        ({"messages": MESSAGES, "n": 2}, "n"),
        ({"messages": MESSAGES, "stream": True}, "stream"),
        ({"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools"),
        ({"messages": [{"role": "user", "content": "word " * 200}]}, "messages"),
    ],
)
async def test_bad_requests_get_400_naming_the_field(setup, body, field):
    _, _, _, _, base_url = setup
    async with aiohttp.ClientSession() as s:
        status, out = await _post(s, base_url + "/chat/completions", body)
        async with s.post(base_url + "/chat/completions", data=b"{not json") as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "body"
    assert status == 400
    assert out["error"]["param"] == field and field.split("[")[0] in out["error"]["message"]


async def test_train_step_then_refit_changes_logprobs_and_version(setup):
    tok, cfg, trainer, worker, base_url = setup
    async with aiohttp.ClientSession() as s:
        outs = [(await _post(s, base_url + "/chat/completions", {"messages": MESSAGES, "max_tokens": 12}))[1]
                for _ in range(4)]
    samples = [
        RolloutSample(rollout_id=f"grp_g{i}", group_id="grp", generation_index=i, reward=float(i % 2),
                      calls=[ModelCall(prompt_token_ids=o["prompt_token_ids"],
                                       generation_token_ids=o["generation_token_ids"],
                                       generation_log_probs=o["generation_log_probs"],
                                       weight_version=o["weight_version"])])
        for i, o in enumerate(outs)
    ]
    fixed_prompt = outs[1]["prompt_token_ids"]
    fixed_gen = outs[1]["generation_token_ids"]  # a rewarded sequence
    before = ray.get(worker.logprobs.remote(fixed_prompt, fixed_gen))
    metrics = trainer.train_step(samples)
    assert metrics["weight_version"] == 1 and metrics["gen_logprob_abs_err"] < 1e-3
    assert ray.get(worker.weight_version.remote()) == 0
    assert ray.get(worker.refit.remote(trainer.state_dict_bytes(), trainer.weight_version)) == 1
    after = ray.get(worker.logprobs.remote(fixed_prompt, fixed_gen))
    assert ray.get(worker.weight_version.remote()) == 1
    assert sum(after) > sum(before)  # the rewarded sequence got more likely
    assert after == pytest.approx(trainer.policy.token_logprobs(fixed_prompt, fixed_gen).tolist(), abs=1e-4)
    # a state dict (not bytes) works too, and replies report the new version
    ray.get(worker.refit.remote(trainer.state_dict_for_refit(), 2))
    async with aiohttp.ClientSession() as s:
        status, out = await _post(s, base_url + "/chat/completions", {"messages": MESSAGES, "max_tokens": 4})
    assert status == 200 and out["weight_version"] == 2
