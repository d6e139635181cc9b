"""The torch generation worker refits between decode steps while a request is in flight: the request is
neither dropped nor restarted (its KV cache stays), its tokens after the switch are the new weights', and
its reply keeps the version of its first token. A plain ``GenerationServer`` on the test's event loop,
a tiny real Hugging Face model, the real ``openai`` client and real HTTP."""

import asyncio
import threading
import time

import aiohttp
import openai
import pytest
import torch

from nemo_rl.algorithms.grpo_config import GenerationConfig, PolicyConfig
from nemo_rl.models.chat import render_prompt
from nemo_rl.models.generation.worker import GenerationServer
from nemo_rl.models.policy import HFPolicy, load_policy
from tests.model_fixtures import tiny_qwen_dir

pytestmark = [pytest.mark.functional, pytest.mark.timeout(120)]

MESSAGES = [{"role": "user", "content": "Invite bo to a meeting called sync"}]
LONG = 300  # tokens: a request that is surely still decoding when the refit lands
CFG = PolicyConfig(device="cpu", max_seq_len=512, generation=GenerationConfig(temperature=1.0, max_new_tokens=24))


def _no_stop(state: dict, stop_ids) -> dict:
    """Zero the stop tokens' (tied) embedding rows: their logit is then 0 while some other token's is
    positive, so greedy decoding never stops early and a request runs to its full ``max_tokens``."""
    state = {k: v.clone() for k, v in state.items()}
    for k in ("model.embed_tokens.weight", "lm_head.weight"):
        if k in state:
            state[k][sorted(stop_ids)] = 0.0
    return state


def _perturbed(state: dict, stop_ids, seed: int) -> dict:
    """Weights far from ``state`` (so their logprobs differ everywhere), stop rows kept at zero."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in state.items():
        out[k] = v + (0.0 if "norm" in k else 0.05) * torch.randn(v.shape, generator=g)
    out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return _no_stop(out, stop_ids)


def _policy(model_dir, state) -> HFPolicy:
    p = load_policy(str(model_dir), "float32", "cpu", CFG.max_seq_len)
    p.load_state(state)
    return p.eval()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    torch.set_num_threads(1)
    model_dir = tiny_qwen_dir(tmp_path_factory.mktemp("tiny_refit"))
    base = load_policy(str(model_dir), "float32", "cpu", CFG.max_seq_len)
    w0 = _no_stop(base.state_dict_cpu(), base.stop_ids)
    w1 = _perturbed(w0, base.stop_ids, seed=1)
    prompt = render_prompt(base.tokenizer, MESSAGES, None)
    return {"dir": model_dir, "w0": w0, "w1": w1, "p0": _policy(model_dir, w0), "p1": _policy(model_dir, w1),
            "prompt": prompt}


@pytest.fixture
async def server(model):
    srv = GenerationServer(CFG, str(model["dir"]), model["w0"], 0, 0, "tiny")
    url = await srv.start()
    yield srv, url
    await srv.stop()


async def _until_decoding(srv: GenerationServer, call: asyncio.Future, steps: int = 0) -> None:
    """Wait (on state, not on a clock) until the request's batch is decoding and has passed ``steps``
    step boundaries (the request is alone on the server, so they are its own)."""
    while srv.stats["decoding_rows"] == 0 or srv.stats["decode_steps"] < steps:
        assert not call.done(), "the request finished before it was seen decoding"
        await asyncio.sleep(0.001)


def _hybrid_logprobs(p0: HFPolicy, p1: HFPolicy, prompt: list[int], gen: list[int], k: int) -> list[float]:
    """The logprobs of ``gen`` when ``p0`` sampled its first ``k`` tokens and ``p1`` the rest, keeping the
    KV cache ``p0`` computed for the prompt and ``gen[:k-1]`` (what an in-place refit between decode steps
    does): the first forward after the switch is ``p1``'s on ``gen[k-1]``, attending to ``p0``'s cache."""
    from transformers import DynamicCache

    ids = torch.tensor([prompt + gen])
    n0, total = len(prompt) + k - 1, len(prompt) + len(gen) - 1
    cache = DynamicCache()
    with torch.no_grad():
        a = p0.model(input_ids=ids[:, :n0], position_ids=torch.arange(n0)[None], cache=cache,
                     use_cache=True).logits
        b = p1.model(input_ids=ids[:, n0:total], position_ids=torch.arange(n0, total)[None], cache=cache,
                     use_cache=True).logits
    logits = torch.cat([a, b], dim=1)[0, len(prompt) - 1:].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(gen)[:, None]).squeeze(-1).tolist()


async def test_refit_lands_while_an_openai_client_request_is_in_flight(model, server):
    srv, url = server
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
    call = asyncio.ensure_future(client.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=0, max_tokens=LONG, logprobs=True))
    await _until_decoding(srv, call, steps=10)
    assert await srv.refit(model["w1"], 1) == 1
    # resolved at a step boundary: the request is still decoding (its reply cannot overtake the refit's
    # answer, which the decode thread queued on this loop before its next step)
    assert not call.done()
    assert srv.stats["refits_in_flight"] == 1 and await srv.weight_version() == 1
    r = await call
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == LONG  # not dropped
    assert len(r.model_extra["generation_token_ids"]) == len(r.model_extra["generation_log_probs"]) == LONG
    assert r.model_extra["weight_version"] == 0  # the version of its first token
    assert r.model_extra["prompt_token_ids"] == model["prompt"]
    after = await client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=4)
    assert after.model_extra["weight_version"] == 1
    stats = await srv.get_stats()
    assert stats["refits"] == 1 and stats["refits_in_flight"] == 1 and stats["requests"] == 2
    await client.close()


async def test_tokens_after_the_switch_carry_the_new_weights_logprobs(model, server):
    srv, _ = server
    prompt, p0, p1 = model["prompt"], model["p0"], model["p1"]
    call = asyncio.ensure_future(srv.generate(prompt, LONG, 0.0))
    await _until_decoding(srv, call, steps=50)
    assert await srv.refit(model["w1"], 1) == 1
    out = await call
    gen, lps = out["token_ids"], out["logprobs"]
    assert len(gen) == LONG and out["weight_version"] == 0
    s0 = p0.token_logprobs(prompt, gen).tolist()
    s1 = p1.token_logprobs(prompt, gen).tolist()
    # k: how many tokens the old weights sampled (the first position the reply leaves the old scoring)
    k = next((i for i, (a, b) in enumerate(zip(lps, s0)) if abs(a - b) > 1e-3), None)
    assert k is not None and 50 < k < LONG  # the switch fell inside the request, after 50 steps at least
    assert max(abs(a - b) for a, b in zip(lps[:k], s0[:k])) < 1e-4  # before it: the old weights exactly
    assert min(abs(a - b) for a, b in zip(lps[k:], s0[k:])) > 1e-4  # after it: never the old weights
    # after it: the new weights over the kept (old) KV cache, exactly; a full rescoring with the new
    # weights differs, because the prefix's keys and values were computed by the old ones
    hybrid = _hybrid_logprobs(p0, p1, prompt, gen, k)
    assert max(abs(a - b) for a, b in zip(lps, hybrid)) < 1e-4
    assert max(abs(a - b) for a, b in zip(lps[k:], s1[k:])) > 1e-3
    # the end of a long reply is mostly new-weights context: closer to the new scoring than to the old
    tail = slice(max(k, LONG - 20), LONG)
    assert sum(abs(a - b) for a, b in zip(lps[tail], s1[tail])) < sum(abs(a - b) for a, b in zip(lps[tail], s0[tail]))


async def test_refit_with_nothing_in_flight(model, server):
    srv, url = server
    base = url.removesuffix("/v1")
    bad = dict(model["w1"])
    bad["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match="model.norm.weight"):
        await srv.refit(bad, 7)
    with pytest.raises(ValueError, match="unexpected key 'nope'"):
        await srv.refit({**model["w1"], "nope": torch.zeros(1)}, 7)
    assert await srv.refit(model["w1"], 3) == 3
    async with aiohttp.ClientSession() as s:
        async with s.get(base + "/health") as r:
            assert (await r.json()) == {"ok": True, "weight_version": 3}
        async with s.post(url + "/chat/completions",
                          json={"messages": MESSAGES, "max_tokens": 6, "temperature": 0}) as r:
            reply = await r.json()
    assert reply["weight_version"] == 3
    expected = model["p1"].token_logprobs(reply["prompt_token_ids"], reply["generation_token_ids"]).tolist()
    assert reply["generation_log_probs"] == pytest.approx(expected, abs=1e-4)  # the new weights, loaded
    stats = await srv.get_stats()
    assert stats["refits"] == 1 and stats["refits_in_flight"] == 0


def _block_until(cond) -> None:
    """Hold the event loop (a loop callback) until the decode thread has done something."""
    for _ in range(100_000):
        if cond():
            return
        time.sleep(0.001)
    raise AssertionError("the decode thread never got there")


async def test_racing_refits_never_step_back_and_all_resolve(model, server):
    srv, _ = server
    prompt, w0, w1 = model["prompt"], model["w0"], model["w1"]
    call = asyncio.ensure_future(srv.generate(prompt, LONG, 0.0))
    await _until_decoding(srv, call)
    # in flight: 3 waits in the slot, 5 replaces its weights, 4 (lower than 5, still waiting) is
    # superseded; every caller gets 5, and only 5's weights load, once
    # the gate: the decode thread loads nothing until 5 has joined the slot (and 4, decided right after 5 in
    # the same loop turn, was superseded), so 3 cannot load first on a starved machine
    gate, apply = threading.Event(), srv._apply_pending

    def held(in_flight: bool) -> None:
        if srv._pending is not None:
            assert gate.wait(60), "the racing refits never joined the slot"
        apply(in_flight)

    srv._apply_pending = held
    try:
        racing = [asyncio.ensure_future(srv.refit(w, v)) for w, v in ((w0, 3), (w1, 5), (w0, 4))]
        for _ in range(60_000):
            if srv._pending is not None and srv._pending.version == 5 and len(srv._pending.waiters) == 2:
                break
            await asyncio.sleep(0.001)
        else:
            raise AssertionError(f"refit 5 never joined 3 in the slot: {srv._pending}")
    finally:
        gate.set()
        srv._apply_pending = apply
    assert await asyncio.gather(*racing) == [5, 5, 5]
    out = await call
    assert len(out["token_ids"]) == LONG and out["weight_version"] == 0
    probe = await srv.generate(prompt, 6, 0.0)
    assert probe["weight_version"] == 5
    assert probe["logprobs"] == pytest.approx(model["p1"].token_logprobs(prompt, probe["token_ids"]).tolist(),
                                              abs=1e-4)  # version 5's weights, not 3's or 4's
    assert (srv.stats["refits"], srv.stats["refits_in_flight"]) == (1, 1)

    # idle: 7 loads at once; 6 arrives after that load but before 7's caller has its answer (the
    # loop is held until the load, and 6's first step was queued ahead of 7's answer): still superseded
    loop = asyncio.get_running_loop()
    newer = asyncio.ensure_future(srv.refit(w1, 7))
    loop.call_soon(_block_until, lambda: srv.stats["refits"] == 2)
    older = asyncio.ensure_future(srv.refit(w0, 6))
    assert await asyncio.gather(newer, older) == [7, 7]
    assert await srv.weight_version() == 7 and srv.stats["refits"] == 2

    # once no refit waits, a lower version is a deliberate rollback and loads
    assert await srv.refit(w0, 2) == 2
    probe = await srv.generate(prompt, 6, 0.0)
    assert probe["weight_version"] == 2
    assert probe["logprobs"] == pytest.approx(model["p0"].token_logprobs(prompt, probe["token_ids"]).tolist(),
                                              abs=1e-4)
