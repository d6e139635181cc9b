"""Generation cuts on the torch worker, a real Ray actor behind real HTTP: a cut reads a live call's
tokens without altering it, and a call sent with the cut continues after it (prefix + tail, one reply)."""

import asyncio
import json
import os
from pathlib import Path

import aiohttp
import pytest
import ray
import torch

from gym_patches.checkpoint.cuts import CALL_ID_HEADER, CUT_FETCH_ROUTE, CUT_ROUTE, CutReply, GenerationCut, PinReply
from nemo_rl.algorithms.grpo_config import GenerationConfig, PolicyConfig
from nemo_rl.models.generation.worker import GenerationWorker, model_files
from nemo_rl.models.policy import load_policy
from tests.model_fixtures import CORPUS, tiny_qwen_dir

pytestmark = [pytest.mark.functional, pytest.mark.timeout(180)]
REPO = Path(__file__).resolve().parents[2]
MESSAGES = [{"role": "user", "content": "Write a long note about the quarterly sync."}]
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}})
    torch.set_num_threads(1)
    model_dir = tiny_qwen_dir(tmp_path_factory.mktemp("tiny"), corpus=[*CORPUS, json.dumps(MESSAGES)])
    cfg = PolicyConfig(device="cpu", max_seq_len=512,
                       generation=GenerationConfig(temperature=1.0, max_new_tokens=32, max_batch_size=16))
    policy = load_policy(str(model_dir), "float32", "cpu", cfg.max_seq_len)
    handle = GenerationWorker.options(num_cpus=1).remote(
        cfg.model_dump(), model_files(model_dir), policy.state_dict_cpu(), 3, 0, "tiny")
    base_url = ray.get(handle.start.remote())
    yield handle, base_url
    ray.get(handle.stop.remote())
    ray.kill(handle)
    ray.shutdown()


def _body(**extra):
    return {"model": "tiny", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "ignore_eos": True, **extra}


async def _chat(session, base_url, body, call_id=None):
    headers = {CALL_ID_HEADER: call_id} if call_id else {}
    async with session.post(base_url + "/chat/completions", json=body, headers=headers) as r:
        return r.status, await r.json()


async def _pin(session, base_url, call_ids, pin="p1", owner="test"):
    async with session.post(base_url + CUT_ROUTE, json={"owner": owner, "pin": pin, "call_ids": call_ids}) as r:
        assert r.status == 200, await r.text()
        return PinReply.model_validate(await r.json()).counts


async def _fetch(session, base_url, pin="p1", owner="test"):
    async with session.post(base_url + CUT_FETCH_ROUTE, json={"owner": owner, "pin": pin}) as r:
        assert r.status == 200, await r.text()
        return CutReply.model_validate(await r.json()).cuts


async def _cut(session, base_url, call_ids):
    """Pin then fetch at once: the calls' cuts at the pin."""
    counts = await _pin(session, base_url, call_ids)
    cuts = await _fetch(session, base_url)
    assert {c: cut.token_count for c, cut in cuts.items()} == counts
    return cuts


async def _cut_when_decoding(session, base_url, call_ids, at_least=8):
    for _ in range(2000):
        counts = await _pin(session, base_url, call_ids)
        if len(counts) == len(call_ids) and min(counts.values()) >= at_least:
            return await _fetch(session, base_url)
        await asyncio.sleep(0.005)
    raise AssertionError("the calls never had tokens to cut")


async def test_a_cut_reads_live_calls_without_altering_them(worker):
    _, base_url = worker
    ids = [f"rollout-{i}.call" for i in range(6)]
    async with aiohttp.ClientSession() as s:
        calls = [asyncio.ensure_future(_chat(s, base_url, _body(), cid)) for cid in ids]
        cuts = await _cut_when_decoding(s, base_url, ids)
        assert await _cut(s, base_url, ["nobody-calls-this"]) == {}
        # a pin holds the counts while the calls go on; its fetch, after they finished, gives exactly those
        counts = await _pin(s, base_url, ids, pin="late")
        replies = await asyncio.gather(*calls)
        late = await _fetch(s, base_url, pin="late")
        assert {c: cut.token_count for c, cut in late.items()} == counts
        assert await _fetch(s, base_url, pin="late") == {}  # fetched once, then forgotten
    for cid, (status, out) in zip(ids, replies):
        assert status == 200, out
        tokens, logprobs = late[cid].unpack()
        assert out["generation_token_ids"][:len(tokens)] == tokens and out["generation_log_probs"][:len(tokens)] == logprobs
        tokens, logprobs = cuts[cid].unpack()
        n = cuts[cid].token_count
        assert 0 < n < MAX_TOKENS and cuts[cid].weight_version == 3
        # the live call went on untouched: its final tokens start with exactly what the cut saw
        assert out["generation_token_ids"][:n] == tokens and out["generation_log_probs"][:n] == logprobs
        assert len(out["generation_token_ids"]) == MAX_TOKENS and "prefix_continuation" not in out


async def test_a_call_sent_with_its_cut_continues_after_the_prefix(worker):
    handle, base_url = worker
    async with aiohttp.ClientSession() as s:
        live = asyncio.ensure_future(_chat(s, base_url, _body(), "ep-1.a"))
        cut = (await _cut_when_decoding(s, base_url, ["ep-1.a"]))["ep-1.a"]
        await live
        before = ray.get(handle.get_stats.remote())
        status, out = await _chat(s, base_url, _body(ng_prefix=cut.model_dump()), "ep-1-a1.b")
    assert status == 200, out
    prefix, prefix_lps = cut.unpack()
    gen = out["generation_token_ids"]
    assert out["prefix_continuation"] == {"call_id": "ep-1.a", "token_count": cut.token_count,
                                          "digest": cut.digest, "discarded": None}
    assert gen[:cut.token_count] == prefix and out["generation_log_probs"][:cut.token_count] == prefix_lps
    tail = len(gen) - cut.token_count
    assert tail > 0 and len(gen) == MAX_TOKENS  # the budget was reduced by the prefix: prefix + tail = total
    assert out["usage"]["completion_tokens"] == MAX_TOKENS and out["weight_version"] == 3
    stats = ray.get(handle.get_stats.remote())
    # only the tail was decoded
    assert stats["generated_tokens"] - before["generated_tokens"] == tail
    assert stats["continued"] == before["continued"] + 1


async def test_a_cut_of_a_continued_call_holds_its_prefix_too(worker):
    _, base_url = worker
    async with aiohttp.ClientSession() as s:
        first = asyncio.ensure_future(_chat(s, base_url, _body(), "ep-2.a"))
        cut1 = (await _cut_when_decoding(s, base_url, ["ep-2.a"]))["ep-2.a"]
        await first
        second = asyncio.ensure_future(_chat(s, base_url, _body(ng_prefix=cut1.model_dump()), "ep-2-a1.b"))
        cut2 = (await _cut_when_decoding(s, base_url, ["ep-2-a1.b"], at_least=cut1.token_count + 4))["ep-2-a1.b"]
        status, out = await second
    assert status == 200
    t1, _ = cut1.unpack()
    t2, _ = cut2.unpack()
    assert t2[:cut1.token_count] == t1 and out["generation_token_ids"][:cut2.token_count] == t2


async def test_a_cut_that_does_not_match_is_discarded_never_continued(worker):
    _, base_url = worker
    async with aiohttp.ClientSession() as s:
        live = asyncio.ensure_future(_chat(s, base_url, _body(), "ep-3.a"))
        cut = (await _cut_when_decoding(s, base_url, ["ep-3.a"]))["ep-3.a"]
        await live
        other = [{"role": "user", "content": "A different prompt entirely."}]
        status, out = await _chat(s, base_url, _body(messages=other, ng_prefix=cut.model_dump()))
        assert status == 200 and out["prefix_continuation"]["discarded"] == "prompt_mismatch"
        assert out["prefix_continuation"]["token_count"] == 0 and len(out["generation_token_ids"]) == MAX_TOKENS
        torn = cut.model_copy(update={"token_count": cut.token_count + 1})
        status, out = await _chat(s, base_url, _body(ng_prefix=torn.model_dump()))
        assert status == 200 and out["prefix_continuation"]["discarded"] == "corrupt"
        status, out = await _chat(s, base_url, _body(ng_prefix={**cut.model_dump(), "digest": "x"}))
        assert status == 400 and out["error"]["param"].startswith("ng_prefix")
        status, out = await _chat(s, base_url, _body(), call_id="bad id with spaces")
        assert status == 400 and CALL_ID_HEADER in out["error"]["message"]


def test_a_cut_survives_its_wire_form_and_names_what_is_wrong():
    cut = GenerationCut.build("c.1", "0" * 64, [5, 6, 7], [-0.5, -1.25, -2.0], 4)
    again = GenerationCut.model_validate_json(cut.model_dump_json())
    assert again.unpack() == ([5, 6, 7], [-0.5, -1.25, -2.0])
    with pytest.raises(ValueError, match="digest does not match"):
        again.model_copy(update={"prompt_digest": "1" * 64}).unpack()
