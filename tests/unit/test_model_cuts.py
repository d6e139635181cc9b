"""The model participant's generation cuts: taken as admission closes, never blocking, saved in the
episode's record, continued once after a restore, forgotten with their rollout.

The cut source here is a named fake (``FakeCutBackend``): it isolates the participant from a backend;
the real backends are tested in tests/functional/test_generation_cuts.py and test_prefix_recovery.py.
"""

from __future__ import annotations

import asyncio

import pytest

from gym_patches.checkpoint.cuts import GenerationCut
from gym_patches.checkpoint.identity import EpisodeId
from gym_patches.checkpoint.model import ModelRecord, PolicyModelParticipant
from gym_patches.checkpoint.records import plain


class FakeCutBackend:
    """A named fake: pins and fetches cuts from a table, or fails/hangs as told."""

    def __init__(self, tokens: dict[str, list[int]], *, fail: Exception | None = None, hang: bool = False,
                 fail_fetch: bool = False):
        self.tokens, self.fail, self.hang, self.fail_fetch, self.asked = tokens, fail, hang, fail_fetch, []
        self.pinned: dict[str, dict[str, int]] = {}

    async def pin(self, pin: str, call_ids: list[str]) -> dict[str, int]:
        self.asked.append(sorted(call_ids))
        if self.hang:
            await asyncio.Event().wait()
        if self.fail is not None:
            raise self.fail
        self.pinned[pin] = {c: len(self.tokens[c]) for c in call_ids if self.tokens.get(c)}
        return dict(self.pinned[pin])

    async def fetch(self, pin: str) -> dict[str, GenerationCut]:
        if self.fail_fetch:
            raise RuntimeError("the backend went away")
        return {c: GenerationCut.build(c, "a" * 64, self.tokens[c][:n], [-0.5] * n, 2)
                for c, n in self.pinned.pop(pin, {}).items()}


async def _generating(model: PolicyModelParticipant, keys: list[str]):
    """One call per key, parked inside the backend (generating) until the returned event is set."""
    release = asyncio.Event()
    started = []

    async def one(key: str) -> None:
        async with model.call(key) as ticket:
            ticket.call_id = f"{key}.c"
            started.append(key)
            await model.run(ticket, release.wait())

    tasks = [asyncio.ensure_future(one(k)) for k in keys]
    while len(started) < len(keys):
        await asyncio.sleep(0)
    return release, tasks


async def test_a_cut_is_noted_at_close_and_its_tokens_join_the_record_after_resume():
    model = PolicyModelParticipant()
    model.cut_source = backend = FakeCutBackend({"r1.c": [1, 2, 3], "r2.c": []})
    release, tasks = await _generating(model, ["r1", "r2"])
    await model.close_admission("block")
    summary = await model.take_cut()
    assert (summary.in_flight, summary.error) == (2, None)  # nothing awaited on the backend in the pause
    # a staged capture: a record for each episode in flight now, its cut's tokens after resume
    captured = {c.key: plain(c.record) for c in await model.capture_records()}
    assert captured == {k: {"episode_id": {"rollout_id": k, "attempt": 0}, "delivered_calls": 0} for k in ("r1", "r2")}
    complete = model.capture_completion()
    await model.open_admission()
    late, failed, why = await complete()
    assert backend.asked == [["r1.c", "r2.c"]] and (failed, why) == (0, None)
    assert set(late) == {"r1"}  # r2 had no token yet: nothing to save
    rec = ModelRecord.model_validate(plain({**captured["r1"], **late["r1"]}))
    assert rec.delivered_calls == 0 and rec.cut_tokens == 3 and rec.cut.unpack()[0] == [1, 2, 3]
    # a blocking commit's export asks for the tokens at once
    backend.tokens["r1.c"].append(4)
    await model.close_admission("block")
    await model.take_cut()
    records = {r["episode_id"]["rollout_id"]: plain(r) for r in await model.export(None)}
    assert set(records) == {"r1"}
    assert ModelRecord.model_validate(records["r1"]).cut.unpack()[0] == [1, 2, 3, 4]
    await model.open_admission()
    release.set()
    await asyncio.gather(*tasks)


async def test_the_newest_fetched_cut_of_a_call_in_flight_is_what_a_resend_continues_from():
    """A call sent again because its backend was lost continues from the newest cut fetched of it (the model
    server asks ``newest_cut`` by call id); a newer snapshot's cut replaces it, and it goes with the call."""
    model = PolicyModelParticipant()
    model.cut_source = backend = FakeCutBackend({"r1.c": [1, 2], "r2.c": [7]})
    release, tasks = await _generating(model, ["r1", "r2"])
    assert model.newest_cut("r1.c") is None  # no cut taken yet
    for tokens in ([1, 2], [1, 2, 3]):
        backend.tokens["r1.c"] = list(tokens)
        await model.close_admission("block")
        await model.take_cut()
        complete = model.capture_completion()
        await model.open_admission()
        await complete()
        assert model.newest_cut("r1.c").unpack()[0] == tokens
    assert model.newest_cut("r2.c").unpack()[0] == [7] and model.newest_cut(None) is None
    release.set()
    await asyncio.gather(*tasks)
    assert model.newest_cut("r1.c") is None and model.newest_cut("r2.c") is None  # the calls ended


async def test_only_calls_of_the_prefix_level_rollouts_are_cut():
    """A rollout at ``turn`` under a ``prefix`` target (an override) is never cut: the prepare names the
    prefix-level rollouts, any attempt of each, and no other call is noted, pinned or saved."""
    model = PolicyModelParticipant()
    model.cut_source = backend = FakeCutBackend({"p1.c": [1, 2], "t1.c": [3, 4], "p2-a1.c": [5]})
    release, tasks = await _generating(model, ["p1", "t1", "p2-a1"])
    await model.close_admission("block")
    summary = await model.take_cut(["p1", "p2"])  # rollout ids: p2's restored attempt is in
    assert (summary.in_flight, summary.error) == (2, None)
    complete = model.capture_completion()
    await model.open_admission()
    late, failed, _ = await complete()
    assert backend.asked == [["p1.c", "p2-a1.c"]] and failed == 0
    assert set(late) == {"p1", "p2-a1"}  # t1 has no cut
    # no prefix-level rollout in flight: nothing is pinned at all
    await model.close_admission("block")
    assert (await model.take_cut([])).in_flight == 0 and model.capture_completion() is None
    assert len(backend.asked) == 1
    # an older caller's prepare (no list): every call in flight, as before
    assert (await model.take_cut()).in_flight == 3
    await model.open_admission()
    release.set()
    await asyncio.gather(*tasks)


@pytest.mark.parametrize("backend, why", [
    (FakeCutBackend({}, fail=RuntimeError("policy backend http://x/v1/ng-cuts returned 500")), "returned 500"),
    (FakeCutBackend({}, hang=True), "did not answer the cut within 0.2s"),
    (FakeCutBackend({"r1.c": [1, 2]}, fail_fetch=True), "the backend went away"),
])
async def test_a_cut_that_fails_never_blocks_and_says_why(backend, why):
    model = PolicyModelParticipant()
    model.cut_source, model.cut_timeout_s = backend, 0.2
    release, tasks = await _generating(model, ["r1"])
    await model.close_admission("block")
    assert (await asyncio.wait_for(model.take_cut(), 0.1)).error is None
    assert model.is_ready()  # generation never blocks a snapshot, cut or not
    complete = model.capture_completion()
    await model.open_admission()
    late, failed, error = await asyncio.wait_for(complete(), 5.0)
    assert late == {} and failed == 1 and why in error
    release.set()
    await asyncio.gather(*tasks)


async def test_without_cut_support_the_prepare_says_so():
    model = PolicyModelParticipant()
    release, tasks = await _generating(model, ["r1"])
    await model.close_admission("block")
    summary = await model.take_cut()
    assert summary.in_flight == 1 and "does not support generation cuts" in summary.error
    assert model.capture_completion() is None
    release.set()
    await model.open_admission()
    await asyncio.gather(*tasks)


async def test_a_newer_cut_supersedes_one_whose_tokens_were_never_asked_for():
    model = PolicyModelParticipant()
    model.cut_source = FakeCutBackend({"r1.c": [1, 2]}, hang=True)
    release, tasks = await _generating(model, ["r1"])
    await model.close_admission("block")
    await model.take_cut()
    old = model.capture_completion()
    await model.open_admission()
    await model.close_admission("block")
    await model.take_cut()  # the older pin task is cancelled by its owner
    late, failed, why = await old()
    assert late == {} and failed == 1 and "superseded" in why
    release.set()
    await model.open_admission()
    await asyncio.gather(*tasks)


async def test_a_restored_cut_is_handed_out_once_for_the_call_it_was_cut_from():
    model = PolicyModelParticipant()
    cut = GenerationCut.build("r1.c", "a" * 64, [4, 5], [-1.0, -2.0], 1)
    record = {"episode_id": {"rollout_id": "r1", "attempt": 0}, "delivered_calls": 2,
              "cut": cut.model_dump(), "cut_tokens": 2}
    assert await model.install([record]) == ["r1-a1"]
    new = EpisodeId.from_capture_key("r1-a1")
    assert model.take_restored_cut(new) == cut
    assert model.take_restored_cut(new) is None  # once
    # a cut whose call is no longer the next one (a reply was delivered since) is dropped unused
    await model.install([{**record, "episode_id": {"rollout_id": "r2", "attempt": 0}}])
    model._delivered[EpisodeId.from_capture_key("r2-a1")] += 1
    assert model.take_restored_cut(EpisodeId.from_capture_key("r2-a1")) is None
    # a trained or abandoned rollout's cut is forgotten with it
    await model.install([{**record, "episode_id": {"rollout_id": "r3", "attempt": 0}}])
    assert model.forget({"r3"}) >= 2
    assert model.take_restored_cut(EpisodeId.from_capture_key("r3-a1")) is None


async def test_a_record_whose_cut_count_disagrees_is_refused_naming_it():
    model = PolicyModelParticipant()
    cut = GenerationCut.build("r1.c", "a" * 64, [4, 5], [-1.0, -2.0], 1)
    bad = {"episode_id": {"rollout_id": "r1", "attempt": 0}, "delivered_calls": 0, "cut": cut.model_dump(),
           "cut_tokens": 3}
    with pytest.raises(Exception, match="model record 0 is invalid.*cut_tokens"):
        await model.install([bad])
