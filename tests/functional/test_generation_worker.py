"""The generation worker as a real Ray actor behind real HTTP (the ``openai`` client and raw aiohttp),
serving a Hugging Face model with its chat template, refit by a real GRPO step."""

import asyncio
import json

import aiohttp
import openai
import pytest
import ray
import torch

from nemo_rl.algorithms.grpo import GRPOTrainer
from nemo_rl.algorithms.grpo_config import GenerationConfig, GRPOConfig, LossConfig, PolicyConfig
from nemo_rl.experience.sample import ModelCall, RolloutSample
from nemo_rl.algorithms.warm_start import warm_start
from nemo_rl.models.chat import render_prompt
from nemo_rl.models.generation.worker import GenerationWorker, model_files
from nemo_rl.models.policy import load_policy
from tests.model_fixtures import CORPUS, tiny_qwen_dir

pytestmark = [pytest.mark.functional, pytest.mark.timeout(120)]

MESSAGES = [
    {"role": "system", "content": "You are an office assistant."},
    {"role": "user", "content": "Invite bo to a meeting called sync on 2023-12-04 at 10:00"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "directory_find_email", "arguments": '{"name": "bo"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "bo@corp.com"},
]
TOOLS = [{"type": "function", "function": {"name": "directory_find_email", "description": "Find an email.",
                                           "parameters": {"type": "object", "properties": {"name": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def setup(ray_cluster, tmp_path_factory):
    torch.set_num_threads(1)
    model_dir = tiny_qwen_dir(tmp_path_factory.mktemp("tiny"), corpus=[*CORPUS, json.dumps(MESSAGES)])
    cfg = PolicyConfig(device="cpu", max_seq_len=256, learning_rate=1e-2,
                       generation=GenerationConfig(temperature=1.0, max_new_tokens=24))
    policy = load_policy(str(model_dir), "float32", "cpu", cfg.max_seq_len)
    trainer = GRPOTrainer(cfg, LossConfig(), GRPOConfig(seed=0), policy)
    worker = GenerationWorker.options(num_cpus=1).remote(
        cfg.model_dump(), model_files(model_dir), trainer.state_dict_for_refit(), trainer.weight_version, 0, "tiny")
    base_url = ray.get(worker.start.remote())
    yield policy.tokenizer, cfg, trainer, worker, base_url
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
    assert out["prompt_token_ids"] == render_prompt(tok, MESSAGES, TOOLS)
    gen, lps = out["generation_token_ids"], out["generation_log_probs"]
    assert 1 <= len(gen) <= 16 and len(lps) == len(gen)
    choice = out["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length", "tool_calls")
    assert choice["finish_reason"] == "length" or gen[-1] == tok.eos_token_id
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
        ({"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools[0].name"),
        ({"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
         "tools[0].function.parameters"),
        ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
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


# ----- the openai package's client ---------------------------------------------
def _client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)


def test_openai_client_chat_with_tools_and_top_logprobs(setup):
    tok, cfg, trainer, worker, base_url = setup
    client = _client(base_url)
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"] and isinstance(models[0].created, int) and models[0].created > 0
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="auto",
                                       temperature=1.0, max_tokens=12, logprobs=True, top_logprobs=3)
    assert r.object == "chat.completion" and r.model == "tiny"
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length", "tool_calls")
    extra = r.model_extra
    assert extra["prompt_token_ids"] == render_prompt(tok, MESSAGES, TOOLS)
    assert len(choice.logprobs.content) == len(extra["generation_token_ids"]) == r.usage.completion_tokens
    for entry in choice.logprobs.content:
        tops = entry.top_logprobs
        assert len(tops) == 3 and [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert tops[0].logprob >= entry.logprob - 1e-6
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    # without top_logprobs the lists are empty (OpenAI's meaning of "none asked for")
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, logprobs=True)
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)


def test_openai_client_unknown_model_is_answered_by_the_served_model(setup):
    _, _, _, _, base_url = setup
    r = _client(base_url).chat.completions.create(model="gpt-4o", messages=MESSAGES[:2], max_tokens=3)
    assert r.model == "tiny"


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": ["not", "an", "object"]}}]},
         "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "string"}}]},
         "tools[0].function.parameters"),
        ({"n": 2}, "n"),
        ({"stop": ["x"]}, "stop"),
    ],
)
def test_openai_client_gets_400_naming_the_field(setup, kwargs, param):
    _, _, _, _, base_url = setup
    with pytest.raises(openai.BadRequestError) as err:
        _client(base_url).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, **kwargs)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param and err.value.body["type"] == "invalid_request_error"


def test_openai_client_receives_parsed_tool_calls(setup):
    """A copy of the policy is taught one tool call, with and without tools in the prompt; the client
    gets it back as ``tool_calls`` only when it listed tools (as vLLM's server parses only then)."""
    tok, cfg, trainer, worker, base_url = setup
    learner = load_policy(tok.name_or_path, "float32", "cpu", 256)
    learner.load_state(trainer.state_dict_for_refit())
    gt = [{"name": "directory_find_email", "arguments": {"name": "bo"}}]
    rows = [{"id": "r", "task_source": "demo", "responses_create_params": {"input": MESSAGES[:2], "tools": TOOLS},
             "ground_truth": gt},
            {"id": "r0", "task_source": "demo", "responses_create_params": {"input": MESSAGES[:2]}, "ground_truth": gt}]
    demo = [*MESSAGES[:2], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "directory_find_email", "arguments": '{"name": "bo"}'}}]}]
    warm_start(learner, rows, steps=300, batch_size=2, lr=5e-3, label_smoothing=0.0, conversations=[demo, demo])
    ray.get(worker.refit.remote(learner.state_dict_cpu(), 99))
    try:
        # No tools listed: the same call text comes back as content, nothing parsed.
        for extra in ({}, {"tools": []}):
            r = _client(base_url).chat.completions.create(model="tiny", messages=MESSAGES[:2], temperature=0,
                                                          max_tokens=40, **extra)
            choice = r.choices[0]
            assert choice.finish_reason == "stop" and not choice.message.tool_calls, choice.message
            assert choice.message.content.startswith("<tool_call>"), choice.message
            assert json.loads(choice.message.content.removeprefix("<tool_call>").removesuffix("</tool_call>")) == {
                "name": "directory_find_email", "arguments": {"name": "bo"}}
        r = _client(base_url).chat.completions.create(model="tiny", messages=MESSAGES[:2], tools=TOOLS,
                                                      temperature=0, max_tokens=40)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        call = choice.message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "directory_find_email" and json.loads(call.function.arguments) == {"name": "bo"}
        assert choice.message.content is None and r.model_extra["weight_version"] == 99
    finally:
        ray.get(worker.refit.remote(trainer.state_dict_for_refit(), trainer.weight_version))
