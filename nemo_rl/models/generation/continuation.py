"""What a generation worker does with a call's ``ng_prefix``: one policy for the torch and vLLM workers.

A saved cut (``gym_patches.checkpoint.cuts``) is continued only when its tokens match its digest and it was
cut after exactly the prompt this call renders; otherwise it is discarded and the call starts over
(``corrupt`` / ``prompt_mismatch``), never continued. A kept prefix reduces the call's budget by its
length; when it already ends the reply (a stop token, or no budget left) nothing more is decoded. Every
call sent with a prefix says what happened in ``prefix_continuation`` and is counted in the worker's
stats: ``continued`` and ``continued_tokens`` (prefix tokens reused), or ``discarded``
(docs/design.md §5.10).

Order of use: ``Continuation.of(cut)``; ``check_prompt(prompt_ids)`` once the prompt is rendered (a
corrupt cut needs no prompt); then, if ``kept``, ``follow(live)``, ``budget``, ``finish_reason``; after the
reply is decoded, ``reply(stats)``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Collection

from gym_patches.checkpoint.cuts import GenerationCut, PrefixContinuation, prompt_digest
from nemo_rl.models.generation.cut_pins import LiveCall

STATS_KEYS = ("continued", "continued_tokens", "discarded", "resent_calls", "resent_from_cut", "resent_cut_tokens")


@dataclass
class Continuation:
    """One call's ``ng_prefix`` and the decision about it: ``ids``/``lps`` while kept, ``reason`` once
    discarded."""

    cut: GenerationCut
    ids: list[int] | None = None
    lps: list[float] | None = None
    reason: str | None = None

    @classmethod
    def of(cls, cut: GenerationCut | None) -> Continuation | None:
        """None for a call sent without a prefix; else the prefix unpacked, or discarded as ``corrupt``."""
        if cut is None:
            return None
        try:
            ids, lps = cut.unpack()
        except ValueError:
            return cls(cut, reason="corrupt")
        return cls(cut, ids, lps)

    @property
    def kept(self) -> bool:
        return self.reason is None

    def check_prompt(self, prompt_ids: list[int]) -> None:
        """Discard the prefix (``prompt_mismatch``) unless it was cut after exactly ``prompt_ids``."""
        if self.kept and prompt_digest(prompt_ids) != self.cut.prompt_digest:
            self.ids, self.lps, self.reason = None, None, "prompt_mismatch"

    def follow(self, live: LiveCall | None) -> None:
        """A cut of the continued call holds the prefix before the tokens decoded now."""
        if live is not None:
            live.prompt_sha = self.cut.prompt_digest
            live.prefix_ids, live.prefix_lps, live.prefix_version = self.ids, self.lps, self.cut.weight_version

    def budget(self, max_new: int, max_len: int, prompt_len: int) -> int:
        """Tokens left to decode after the prefix: the call's budget, capped by the context, less the prefix."""
        return min(max_new, max_len - prompt_len) - len(self.ids)

    def finish_reason(self, stop_ids: Collection[int], ignore_eos: bool, budget: int) -> str | None:
        """How the reply ends when the prefix already holds all of it (``stop`` / ``length``); None: decode on."""
        if self.ids[-1] in stop_ids and not ignore_eos:
            return "stop"
        return "length" if budget <= 0 else None

    def weight_version(self, tail_version: int | None) -> int:
        """The reply's version: the oldest that sampled any of its tokens (None: no tail was decoded)."""
        v = self.cut.weight_version
        return v if tail_version is None else min(v, tail_version)

    def reply(self, stats: dict) -> PrefixContinuation:
        """The reply's ``prefix_continuation``, counted in ``stats``."""
        if not self.kept:
            stats["discarded"] += 1
            return PrefixContinuation(call_id=self.cut.call_id, token_count=0, digest=self.cut.digest,
                                      discarded=self.reason)
        stats["continued"] += 1
        stats["continued_tokens"] += len(self.ids)
        return PrefixContinuation(call_id=self.cut.call_id, token_count=len(self.ids), digest=self.cut.digest)


def count_resend(stats: dict, resend: str | None, call_id: str | None, plan: Continuation | None) -> None:
    """A call a model server sent again because the worker it was on was lost (``X-NG-Resend``), counted as
    it arrives (once its prefix is decided): whether it continues from a cut of itself (the same call id) and
    the tokens that keeps, and when the first came (this process's monotonic clock; ``stats_now`` gives
    its age, so the recovery measures from its own clock, never across two: docs/design.md §5.12)."""
    if resend is None:
        return
    stats["resent_calls"] += 1
    stats.setdefault("first_resent_mono", time.monotonic())
    if plan is not None and plan.kept and plan.cut.call_id == call_id:
        stats["resent_from_cut"] += 1
        stats["resent_cut_tokens"] += len(plan.ids)


def stats_now(stats: dict) -> dict:
    """A copy of a worker's stats for ``get_stats``: the first re-sent call's time as its age in seconds
    (``first_resent_age_s``), which the reader subtracts from its own clock."""
    out = dict(stats)
    first = out.pop("first_resent_mono", None)
    if first is not None:
        out["first_resent_age_s"] = time.monotonic() - first
    return out


def init_stats(stats: dict) -> None:
    """The continuation counters a worker's stats start with (0 each)."""
    for key in STATS_KEYS:
        stats.setdefault(key, 0)
