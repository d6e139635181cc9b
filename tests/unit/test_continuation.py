"""The continuation policy both generation workers share (``nemo_rl.models.generation.continuation``) and
the live call a cut reads (``cut_pins.LiveCall``), on real cuts in their wire form."""

from gym_patches.checkpoint.cuts import GenerationCut, prompt_digest
from nemo_rl.models.generation.continuation import Continuation, count_resend, init_stats, stats_now
from nemo_rl.models.generation.cut_pins import LiveCall

PROMPT = [11, 12, 13, 14]
EOS = 2


def _cut(ids=(5, 6, 7), version=3, prompt=PROMPT) -> GenerationCut:
    wire = GenerationCut.build("key.1", prompt_digest(prompt), list(ids), [-0.5] * len(ids), version)
    return GenerationCut.model_validate_json(wire.model_dump_json())


def _stats() -> dict:
    stats: dict = {}
    init_stats(stats)
    return stats


def test_no_prefix_is_no_continuation():
    assert Continuation.of(None) is None


def test_a_torn_cut_is_discarded_as_corrupt_before_any_prompt_is_rendered():
    torn = _cut().model_copy(update={"digest": "0" * 64})
    plan = Continuation.of(torn)
    assert not plan.kept and plan.reason == "corrupt" and plan.ids is None
    stats = _stats()
    reply = plan.reply(stats)
    assert (reply.token_count, reply.discarded, reply.digest) == (0, "corrupt", torn.digest)
    assert {k: stats[k] for k in ("continued", "continued_tokens", "discarded")} == {
        "continued": 0, "continued_tokens": 0, "discarded": 1}


def test_a_cut_of_another_prompt_is_discarded_never_continued():
    plan = Continuation.of(_cut())
    plan.check_prompt(PROMPT + [15])
    assert not plan.kept and plan.reason == "prompt_mismatch" and plan.ids is None
    stats = _stats()
    assert plan.reply(stats).discarded == "prompt_mismatch" and stats["discarded"] == 1


def test_a_kept_prefix_reduces_the_budget_and_is_counted():
    plan = Continuation.of(_cut(version=3))
    plan.check_prompt(PROMPT)
    assert plan.kept and plan.ids == [5, 6, 7]
    assert plan.budget(max_new=10, max_len=100, prompt_len=len(PROMPT)) == 7
    assert plan.budget(max_new=10, max_len=8, prompt_len=len(PROMPT)) == 1  # capped by the context
    assert plan.finish_reason({EOS}, ignore_eos=False, budget=7) is None
    assert plan.finish_reason({EOS}, ignore_eos=False, budget=0) == "length"
    assert plan.weight_version(None) == 3 and plan.weight_version(5) == 3 and plan.weight_version(1) == 1
    stats = _stats()
    reply = plan.reply(stats)
    assert (reply.token_count, reply.discarded) == (3, None)
    assert {k: stats[k] for k in ("continued", "continued_tokens", "discarded")} == {
        "continued": 1, "continued_tokens": 3, "discarded": 0}


def test_a_call_sent_again_is_counted_with_the_cut_of_itself_it_continues_from():
    """``X-NG-Resend``: counted as it arrives; only a kept cut of the same call (its call id) counts as
    continued, with the tokens it keeps; a restored cut (another call's id) or a discarded one does not."""
    stats = _stats()
    count_resend(stats, None, "key.1", None)  # not sent again: nothing
    assert stats["resent_calls"] == 0 and "first_resent_age_s" not in stats_now(stats)
    own = Continuation.of(_cut())
    own.check_prompt(PROMPT)
    count_resend(stats, "1", "key.1", own)
    first = stats["first_resent_mono"]
    other = Continuation.of(_cut())
    other.check_prompt(PROMPT)
    count_resend(stats, "2", "key-a1.2", other)  # a restored attempt's call continuing an older call's cut
    mismatch = Continuation.of(_cut())
    mismatch.check_prompt(PROMPT + [15])
    count_resend(stats, "1", "key.1", mismatch)
    count_resend(stats, "1", "key.3", None)
    assert (stats["resent_calls"], stats["resent_from_cut"], stats["resent_cut_tokens"]) == (4, 1, 3)
    assert stats["first_resent_mono"] == first  # the first one's time, on this process's monotonic clock
    now = stats_now(stats)  # what get_stats hands the recovery: an age, read against its own clock
    assert "first_resent_mono" not in now and 0 <= now["first_resent_age_s"] < 60


def test_a_prefix_ending_in_a_stop_token_ends_the_reply_unless_eos_is_ignored():
    plan = Continuation.of(_cut(ids=(5, EOS)))
    plan.check_prompt(PROMPT)
    assert plan.finish_reason({EOS}, ignore_eos=False, budget=9) == "stop"
    assert plan.finish_reason({EOS}, ignore_eos=True, budget=9) is None


def test_a_cut_of_a_continued_call_holds_the_prefix_then_the_tokens_with_logprobs():
    plan = Continuation.of(_cut(version=3))
    plan.check_prompt(PROMPT)
    live = LiveCall()
    assert live.decoded() == 0  # prompt not known yet
    plan.follow(live)
    assert live.decoded() == 3  # the prefix only: nothing of its own decoded yet
    live.version = 4
    live.ids.extend([8, 9])
    live.lps.append(-0.25)  # the second token's logprob has not landed: it does not count
    assert live.decoded() == 4
    cut = live.cut("key.1", 4)
    ids, lps = cut.unpack()
    assert ids == [5, 6, 7, 8] and lps == [-0.5, -0.5, -0.5, -0.25]
    assert cut.weight_version == 3 and cut.prompt_digest == prompt_digest(PROMPT)
    assert live.cut("key.1", 2).unpack()[0] == [5, 6]  # an earlier pin: a prefix of the prefix
