"""The model server's record of each episode's finished calls, and their replay into a fresh attempt.

A rollout whose restart-only servers declare themselves *replayable* (their state is a function of the
calls they received, and those calls act nowhere else) is brought back by running its agent and tools
again from the prompt, while the model server answers the calls it had already finished from this
record: the tools rebuild the state nobody could save, and only what was not finished is generated.

- **Record** (``record_calls`` in the model server's config; off by default): per episode, each
  delivered call as one JSON fragment, serialised once when it is delivered: the digest of the request
  as the agent sent it (``request_digest``: its settings and every input item, canonical JSON), one
  short digest per input item (``item_digests``: where a later request first differs), and the reply
  exactly as the agent got it (``reply``: token ids, logprobs, ``weight_version`` and all). The model's
  checkpoint record carries them as ``calls`` (``gym_patches.checkpoint.model``).
- **Replay**: a restore that names the episode for replay installs its calls as a queue. The episode's
  call ``i`` is answered from ``queue[i]`` while its request digest equals the recorded one; at the first
  call that differs the rest of the queue is dropped and a *divergence* is noted (which call, which input
  item and what it is); from there, and after the last recorded call, calls are generated live.
- **What the caller sees**: the last output item of a replayed reply carries ``replay: {"replayed":
  true, "call": i}``; the first live reply of a replayed episode ``replay: {"replayed": false, "call": i}``,
  with ``"divergence": {...}`` when a differing request ended the replay (an episode replayed with no
  recorded call gets it on its call 0, so every rollout that came back by replay says so). Counts: ``ReplayStats`` (model status, ``GET /ng-replay/v1/stats``).

Nothing the model server itself adds to a reply (this annotation) counts in a digest: an agent that sends
a replayed item back unchanged still matches.
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, field_validator

from gym_patches.checkpoint.identity import EpisodeId
from gym_patches.checkpoint.records import Fragment
from gym_patches.wire_models import REPLAY_STATS_ROUTE, ResponsesReply

__all__ = ["REPLAY_STATS_ROUTE", "CallBook", "CallPlan", "Divergence", "RecordedCall", "ReplayAnnotation",
           "ReplayReport", "ReplayStats", "annotated", "request_digest"]

REPLAY_FIELD = "replay"  # the annotation on the last output item of a replayed or diverged reply
ITEM_DIGEST_CHARS = 16  # enough to tell items apart; the request digest is the full sha256
DIVERGENCES_KEPT = 1000  # the newest divergences the stats route lists

DivergenceKind = Literal["tool_output", "model_output", "agent_item", "fewer_items", "settings"]

_CANONICAL = msgspec.json.Encoder(order="sorted")  # dict keys sorted: equal values, equal bytes


def canonical(value: Any) -> bytes:
    """``value`` as canonical JSON (keys sorted, no spaces, shortest float form)."""
    return _CANONICAL.encode(value)


def _without_annotation(item: Any) -> Any:
    if type(item) is dict and REPLAY_FIELD in item:
        return {k: v for k, v in item.items() if k != REPLAY_FIELD}
    return item


@dataclass(frozen=True)
class RequestDigest:
    """One request's digest (``request``: settings and every input item) and its items' short digests."""

    request: str
    items: list[str]


def request_digest(body: dict[str, Any]) -> RequestDigest:
    """The digest of a Responses request body as the agent sent it: every field but ``input`` as its
    settings, and each input item (a string ``input`` is one item); the path's capture key, headers and
    the model server's own ``replay`` annotation never count."""
    raw_items = body.get("input")
    items = [raw_items] if not isinstance(raw_items, list) else raw_items
    settings = {k: v for k, v in body.items() if k != "input"}
    whole = hashlib.sha256(canonical(settings))
    short: list[str] = []
    for item in items:
        full = hashlib.sha256(canonical(_without_annotation(item))).hexdigest()
        whole.update(full.encode())
        short.append(full[:ITEM_DIGEST_CHARS])
    return RequestDigest(whole.hexdigest(), short)


class RecordedCall(BaseModel):
    """One finished call in a model record: what was asked (digests) and the reply as returned."""

    model_config = ConfigDict(extra="forbid")

    request_digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    item_digests: list[str]
    reply: dict[str, Any]

    @field_validator("reply")
    @classmethod
    def _a_responses_reply(cls, value: dict[str, Any]) -> dict[str, Any]:
        ResponsesReply.model_validate(value)  # the envelope; the dict is kept exactly as recorded
        if not value.get("output") or not isinstance(value["output"][-1], dict):
            raise ValueError("reply has no output item")
        return value


class Divergence(BaseModel):
    """Where a replayed episode's request first differed from the recorded one: the call (its index in
    the episode), the input item (None when only the settings differ) and what that item is."""

    model_config = ConfigDict(extra="forbid")

    call: int = Field(ge=0)
    item: int | None = Field(default=None, ge=0)
    kind: DivergenceKind
    item_type: str | None = None  # the differing item's type (``function_call_output``, ``message``, ...)
    tool: str | None = None  # for a tool output: the tool that produced it


class ReplayAnnotation(BaseModel):
    """``replay`` on the last output item: a replayed reply, or the first live one of a replayed episode
    (after a divergence, or once its recorded calls ran out)."""

    model_config = ConfigDict(extra="forbid")

    replayed: bool
    call: int = Field(ge=0)
    divergence: Divergence | None = None


class ReplayStats(BaseModel):
    """What the model server counted since it started (the model status's ``replay``)."""

    recording: bool = False  # ``record_calls``: finished calls are recorded
    episodes_replayed: int = 0  # episodes installed for replay (0 recorded calls included)
    calls_replayed: int = 0  # replies answered from a record (no backend call)
    calls_live_after_divergence: int = 0  # replies generated for an episode after it diverged
    divergences: int = 0
    queued_calls: int = 0  # recorded calls still waiting to be replayed


class DivergenceReport(Divergence):
    """A divergence and the attempt it happened in (the stats route's list)."""

    capture_key: str


class ReplayReport(BaseModel):
    """``GET /ng-replay/v1/stats``: the counts and the newest divergences, oldest first."""

    stats: ReplayStats
    divergences: list[DivergenceReport] = Field(default_factory=list)


def locate_divergence(call: int, body: dict[str, Any], got: RequestDigest, recorded: RecordedCall) -> Divergence:
    """The first input item whose digest differs from the recorded one, and what it is."""
    old = recorded.item_digests
    first = next((i for i, (a, b) in enumerate(zip(got.items, old)) if a != b), None)
    if first is None:
        if len(got.items) == len(old):
            return Divergence(call=call, kind="settings")
        first = min(len(got.items), len(old))
    raw = body.get("input")
    items = raw if isinstance(raw, list) else [raw]
    if first >= len(items):
        return Divergence(call=call, item=first, kind="fewer_items")
    item = items[first]
    item_type = item.get("type", "message" if "role" in item else None) if isinstance(item, dict) else "text"
    if item_type == "function_call_output":
        return Divergence(call=call, item=first, kind="tool_output", item_type=item_type,
                          tool=_tool_of(items[:first], item.get("call_id")))
    made_by_model = item_type == "function_call" or (item_type == "message" and item.get("role") == "assistant")
    return Divergence(call=call, item=first, kind="model_output" if made_by_model else "agent_item",
                      item_type=item_type if isinstance(item_type, str) else None)


def _tool_of(earlier: list[Any], call_id: Any) -> str | None:
    """The name of the function call ``call_id`` among the items before its output."""
    for item in reversed(earlier):
        if isinstance(item, dict) and item.get("type") == "function_call" and item.get("call_id") == call_id:
            name = item.get("name")
            return name if isinstance(name, str) else None
    return None


def call_fragment(digest: RequestDigest, reply: bytes) -> Fragment:
    """One recorded call as a JSON fragment: the reply's bytes spliced in as they were sent."""
    return msgspec.Raw(canonical({"request_digest": digest.request, "item_digests": digest.items,
                                  "reply": msgspec.Raw(reply)}))


def annotated(reply: dict[str, Any], note: ReplayAnnotation) -> dict[str, Any]:
    """A copy of ``reply`` whose last output item carries ``note`` (the recorded reply is not changed)."""
    output = list(reply["output"])
    output[-1] = {**output[-1], REPLAY_FIELD: note.model_dump(exclude_none=True)}
    return {**reply, "output": output}


@dataclass(frozen=True)
class CallPlan:
    """How the model server answers one call of an episode: from ``recorded`` (a replay) or live
    (``recorded`` None), with the divergence noted at this call, if any; ``first_live``: the first live
    call of a replayed episode, whose reply says so (``live_note``)."""

    index: int
    digest: RequestDigest | None = None  # None: neither recorded nor replayed
    recorded: RecordedCall | None = None
    divergence: Divergence | None = None
    first_live: bool = False

    def live_note(self) -> ReplayAnnotation | None:
        """The annotation a live reply carries: only the first one of a replayed episode has one."""
        if not self.first_live:
            return None
        return ReplayAnnotation(replayed=False, call=self.index, divergence=self.divergence)

    def reply_for_agent(self) -> dict[str, Any]:
        """The replayed reply as the agent gets it (annotated)."""
        assert self.recorded is not None
        return annotated(self.recorded.reply, ReplayAnnotation(replayed=True, call=self.index))


LIVE = CallPlan(index=-1)  # a call of no episode, or one nothing records or replays


@dataclass
class _Episode:
    """One attempt's calls: the recorded ones (trajectory order from call 0, also those still queued for
    replay: they stay this attempt's record until a divergence drops them) and the replay queue."""

    calls: list[Fragment] = field(default_factory=list)
    queue: list[RecordedCall] | None = None  # queue[i] is call i
    replayed: int = 0  # calls of the queue delivered so far
    diverged: bool = False
    replaying: bool = False  # installed for replay, its first live call not delivered yet

    def unplayed(self) -> int:
        return 0 if self.queue is None else max(0, len(self.queue) - self.replayed)


class CallBook:
    """Every episode's recorded calls and replay queue on one model server."""

    def __init__(self) -> None:
        self.recording = False
        self._episodes: dict[EpisodeId, _Episode] = {}
        self._stats = ReplayStats()
        self._queued = 0  # calls in every queue not replayed yet
        self._divergences: deque[DivergenceReport] = deque(maxlen=DIVERGENCES_KEPT)

    # -- calls -----------------------------------------------------------------
    def plan(self, episode: EpisodeId, index: int, body: dict[str, Any]) -> CallPlan:
        """How to answer ``episode``'s call number ``index`` (its delivered count) asking ``body``."""
        entry = self._episodes.get(episode)
        queue = entry.queue if entry is not None else None
        if not self.recording and not queue:
            return CallPlan(index)
        digest = request_digest(body)
        if entry is None or queue is None:
            return CallPlan(index, digest, first_live=entry is not None and entry.replaying)
        if index >= len(queue):  # past the last recorded call: live from here
            self._end_queue(entry)
            return CallPlan(index, digest, first_live=entry.replaying)
        recorded = queue[index]
        if recorded.request_digest == digest.request:
            return CallPlan(index, digest, recorded=recorded)
        divergence = locate_divergence(index, body, digest, recorded)
        self._end_queue(entry)
        entry.diverged = True
        del entry.calls[index:]  # the recorded calls from here belong to another trajectory
        self._stats.divergences += 1
        self._divergences.append(DivergenceReport(capture_key=episode.capture_key, **divergence.model_dump()))
        return CallPlan(index, digest, divergence=divergence, first_live=entry.replaying)

    def delivered(self, episode: EpisodeId, plan: CallPlan, reply: bytes | None) -> None:
        """The reply of ``plan`` reached the agent: count it, and record a live one (serialised once)."""
        entry = self._episodes.get(episode)
        if plan.recorded is not None:
            self._stats.calls_replayed += 1
            if entry is not None and entry.queue is not None:
                entry.replayed += 1
                self._queued -= 1
            return
        if entry is not None:
            entry.replaying = False
            if entry.diverged:
                self._stats.calls_live_after_divergence += 1
        if not self.recording or plan.digest is None or reply is None:
            return
        if entry is None:
            entry = self._episodes[episode] = _Episode()
        if len(entry.calls) == plan.index:  # calls stay a gapless prefix of the trajectory
            entry.calls.append(call_fragment(plan.digest, reply))

    # -- records ---------------------------------------------------------------
    def calls_of(self, episode: EpisodeId) -> tuple[Fragment, ...]:
        """The calls ``episode``'s record carries (fragments, as they were recorded)."""
        entry = self._episodes.get(episode)
        return () if entry is None else tuple(entry.calls)

    def has_calls(self, episode: EpisodeId) -> bool:
        entry = self._episodes.get(episode)
        return entry is not None and bool(entry.calls)

    def install(self, episode: EpisodeId, calls: list[dict[str, Any]], parsed: list[RecordedCall], *,
                replay: bool, delivered: int) -> None:
        """Give the new attempt ``episode`` the calls of its saved record: all of them, queued for
        replay (``replay``: its agent starts again from the prompt), or the ``delivered`` ones its agent
        continues after (a restore at its turn)."""
        fragments = [msgspec.Raw(canonical(call)) for call in (calls if replay else calls[:delivered])]
        entry = _Episode(calls=fragments, queue=list(parsed) if replay and parsed else None, replaying=replay)
        if entry.calls or entry.queue or replay:
            self._episodes[episode] = entry
            self._queued += entry.unplayed()
        if replay:
            self._stats.episodes_replayed += 1

    def drop(self, gone: Callable[[EpisodeId], bool]) -> int:
        """Forget every episode ``gone`` names (retired, superseded or trained); how many."""
        doomed = [e for e in self._episodes if gone(e)]
        for episode in doomed:
            self._end_queue(self._episodes.pop(episode))
        return len(doomed)

    def _end_queue(self, entry: _Episode) -> None:
        self._queued -= entry.unplayed()
        entry.queue = None

    def episodes(self) -> Iterable[EpisodeId]:
        return self._episodes.keys()

    # -- counts ------------------------------------------------------------------
    def stats(self) -> ReplayStats:
        return self._stats.model_copy(update={"recording": self.recording, "queued_calls": self._queued})

    def report(self) -> ReplayReport:
        return ReplayReport(stats=self.stats(), divergences=list(self._divergences))
