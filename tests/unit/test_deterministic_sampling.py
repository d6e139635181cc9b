"""Deterministic sampling (``grpo.deterministic``, ``nemo_rl.models.generation.call_seeds``): the seed of a
call comes from the run's seed, its rollout's identity and its index, not its attempt; and on a real tiny
torch model behind a plain ``GenerationServer`` (real HTTP, the real ``openai`` client with the headers
Gym's model server sends), a call's tokens are the same alone or among concurrent calls, after a worker
restart, on another attempt of its rollout, and continued after a generation cut."""

from __future__ import annotations

import asyncio

import openai
import pytest
import torch

from gym_patches.checkpoint.cuts import CALL_ID_HEADER, CALL_INDEX_HEADER, GenerationCut, prompt_digest
from nemo_rl.algorithms.grpo_config import GenerationConfig, PolicyConfig
from nemo_rl.models.chat import render_prompt
from nemo_rl.models.generation.call_seeds import (
    CallDraws,
    call_seed,
    parse_call_index,
    request_seed,
    rollout_identity,
    token_at,
    uniform,
)
from nemo_rl.models.generation.worker import GenerationServer
from nemo_rl.models.policy import load_policy
from tests.model_fixtures import tiny_qwen_dir

MAX_NEW = 40
CFG = PolicyConfig(device="cpu", max_seq_len=512, generation=GenerationConfig(temperature=1.0, max_new_tokens=MAX_NEW))
PROMPTS = [[{"role": "user", "content": text}] for text in
           ("Invite bo to a meeting called sync", "Created event E2.", "alpha beta gamma delta Done.",
            "Use the tools to do the task, then say Done.")]


# ----------------------------------------------------------------------------- the seed, pure
def test_the_identity_leaves_out_both_attempts():
    assert rollout_identity("s3p17_g2_a0123abcd.ffee00") == "s3p17_g2"
    assert rollout_identity("s3p17_g2_a9f9f9f9f-a2.00aa11") == "s3p17_g2"  # another ledger attempt, Gym attempt 2
    assert rollout_identity("val_s0_3_abcdef012345.12") == "val_s0_3_abcdef012345"  # not RL's shape: as sent
    assert rollout_identity("other-a3.x") == "other"


def test_the_seed_follows_run_seed_rollout_and_index_only():
    base = call_seed(42, "s1p0_g0", 0)
    assert call_seed(42, "s1p0_g0", 0) == base
    assert len({base, call_seed(43, "s1p0_g0", 0), call_seed(42, "s1p0_g1", 0), call_seed(42, "s1p1_g0", 0),
                call_seed(42, "s1p0_g0", 1)}) == 5
    a = request_seed(42, "s1p0_g0_a1111.1", 2, "unused")
    b = request_seed(42, "s1p0_g0_a2222-a3.2", 2, "unused")
    assert a == b == call_seed(42, "s1p0_g0", 2)
    assert request_seed(42, None, None, "k1") != request_seed(42, None, None, "k2")  # untracked: by its request
    assert 0 <= base < 2**63


def test_the_index_header_is_checked_naming_it():
    assert parse_call_index(None) is None and parse_call_index("7") == 7
    for bad in ("-1", "x", "1.5", "9" * 12):
        with pytest.raises(ValueError, match=CALL_INDEX_HEADER):
            parse_call_index(bad)


def test_draws_are_by_counter_and_a_sample_of_the_distribution():
    assert uniform(5, 3) == uniform(5, 3) and uniform(5, 3) != uniform(5, 4) and uniform(6, 3) != uniform(5, 3)
    assert CallDraws(5, offset=3).u(0) == CallDraws(5).u(3)  # a continuation draws token 3 as the whole call did
    logp = torch.log_softmax(torch.tensor([0.0, 1.0, 2.0, -1000.0]), dim=-1)
    counts = [0] * 4
    for t in range(4000):
        counts[token_at(logp, uniform(1, t))] += 1
    expected = logp.exp().tolist()
    for c, p in zip(counts, expected):
        assert abs(c / 4000 - p) < 0.03, (counts, expected)
    assert token_at(logp, 0.0) == 0 and token_at(logp, 1.0 - 2**-53) == 2  # a probability of 0 is never drawn


# ----------------------------------------------------------------------------- a real worker
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return tiny_qwen_dir(tmp_path_factory.mktemp("tiny_deterministic"))


async def _serve(model_dir, deterministic: bool = True) -> tuple[GenerationServer, openai.AsyncOpenAI]:
    srv = GenerationServer(CFG, str(model_dir), None, 0, 42, "tiny", deterministic=deterministic)
    url = await srv.start()
    return srv, openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0)


async def _call(client: openai.AsyncOpenAI, messages, call_id: str | None, index: int | None,
                prefix: GenerationCut | None = None) -> list[int]:
    headers = {}
    if call_id is not None:
        headers[CALL_ID_HEADER] = call_id
    if index is not None:
        headers[CALL_INDEX_HEADER] = str(index)
    extra = {"ignore_eos": True, **({"ng_prefix": prefix.model_dump()} if prefix is not None else {})}
    reply = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_NEW,
                                                 extra_headers=headers, extra_body=extra)
    return reply.model_extra["generation_token_ids"], reply.model_extra["generation_log_probs"]


async def test_a_calls_tokens_do_not_depend_on_concurrency_restarts_or_attempts(model_dir):
    srv, client = await _serve(model_dir)
    try:
        alone = [await _call(client, m, f"s1p{i}_g0_a{'1' * 8}.x{i}", 1) for i, m in enumerate(PROMPTS)]
        together = await asyncio.gather(*[_call(client, m, f"s1p{i}_g0_a{'2' * 8}-a3.y{i}", 1)
                                          for i, m in enumerate(PROMPTS)])
        assert srv.stats["batches"] == 2 * len(PROMPTS)  # one call at a time, whatever arrived together
        other_index = await _call(client, PROMPTS[0], f"s1p0_g0_a{'1' * 8}.z", 2)
        sibling = await _call(client, PROMPTS[0], f"s1p0_g1_a{'1' * 8}.z", 1)
    finally:
        await srv.stop()
    assert [t for t, _ in together] == [t for t, _ in alone]
    assert [lp for _, lp in together] == [lp for _, lp in alone]
    assert other_index[0] != alone[0][0] and sibling[0] != alone[0][0]  # another seed, other tokens
    srv, client = await _serve(model_dir)  # a new worker (a restart) draws the same
    try:
        again = await _call(client, PROMPTS[2], f"s1p2_g0_a{'3' * 8}.w", 1)
    finally:
        await srv.stop()
    assert again == alone[2]


async def test_a_call_continued_after_a_cut_draws_what_the_whole_call_drew(model_dir):
    """Counter-based draws: token k of a continued call is drawn with the same u as in the uninterrupted
    call. The continuation re-prefills the prefix (its floats may differ from the step-by-step decode in
    the last bits), so the test checks the tokens exactly and the logprobs to 1e-5."""
    srv, client = await _serve(model_dir)
    policy = load_policy(str(model_dir), "float32", "cpu", CFG.max_seq_len)
    try:
        for i, messages in enumerate(PROMPTS):
            call_id = f"s2p{i}_g1_a{'4' * 8}.c{i}"
            whole, whole_lps = await _call(client, messages, call_id, 0)
            prompt = render_prompt(policy.tokenizer, messages, None)
            for k in (1, 7, 23):
                cut = GenerationCut.build(call_id, prompt_digest(prompt), whole[:k], whole_lps[:k], 0)
                ids, lps = await _call(client, messages, f"s2p{i}_g1_a{'5' * 8}-a1.r", 0, prefix=cut)
                assert ids == whole, (i, k)
                assert lps[:k] == whole_lps[:k]
                assert max(abs(a - b) for a, b in zip(lps[k:], whole_lps[k:])) < 1e-5
        assert srv.stats["continued"] == 3 * len(PROMPTS)
    finally:
        await srv.stop()


async def test_without_the_mode_the_worker_batches_and_keeps_one_generator(model_dir):
    srv, client = await _serve(model_dir, deterministic=False)
    try:
        first = await _call(client, PROMPTS[0], "s1p0_g0_aaaaaaaa.1", 0)
        second = await _call(client, PROMPTS[0], "s1p0_g0_aaaaaaaa.2", 0)
    finally:
        await srv.stop()
    assert first[0] != second[0]  # the worker's one generator moved on: the same call draws anew
