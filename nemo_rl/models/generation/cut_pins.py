"""The backend half of generation cuts (``gym_patches.checkpoint.cuts``), shared by both generation workers.

A worker registers each call named by ``X-NG-Call-Id`` from arrival to reply (``tracking``); a pin
notes how many tokens each named call has decoded and keeps a reference to it, so its fetch, later,
returns exactly those tokens even if the call has finished meanwhile (decoded tokens are only ever
appended). One pin is kept per owner (a model server) until it is fetched or replaced.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

from aiohttp import web
from pydantic import ValidationError

from gym_patches.checkpoint.cuts import CutReply, CutRequest, FetchRequest, GenerationCut, PinReply
from nemo_rl.models.generation.protocol import error_body


@dataclass
class LiveCall:
    """A call named by ``X-NG-Call-Id``, from arrival to reply: what a cut of it reads.

    ``ids``/``lps`` are the tokens the worker decodes for it now, appended in place (each token id before
    its logprob) by the torch worker's decode thread or by vLLM's stream on the event loop, so a cut reads a
    consistent prefix without a lock; ``prefix_*`` are a continued cut's tokens, before them.
    """

    prompt_sha: str | None = None  # known once the prompt's token ids are
    prefix_ids: list[int] = field(default_factory=list)
    prefix_lps: list[float] = field(default_factory=list)
    prefix_version: int | None = None
    ids: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    version: int | None = None  # the weights that sample ``ids`` (None: not started)

    def decoded(self) -> int:
        """Tokens decoded so far, a continued cut's prefix included (0: none yet, or the prompt not known)."""
        if self.prompt_sha is None:
            return 0
        own = min(len(self.ids), len(self.lps)) if self.version is not None else 0
        return len(self.prefix_ids) + own

    def cut(self, call_id: str, upto: int) -> GenerationCut:
        """The first ``upto`` tokens (prefix + own), as a pin counted them: decoded tokens are only ever
        appended, so this is what the call held at the pin, also once it has finished."""
        assert self.prompt_sha is not None, "a pinned call knows its prompt"
        ids, lps, version = self.prefix_ids, self.prefix_lps, self.prefix_version
        own = upto - len(ids)
        if own > 0 and self.version is not None:
            ids, lps = ids + self.ids[:own], lps + self.lps[:own]
            version = self.version if version is None else min(version, self.version)
        assert version is not None, "a pinned call has tokens"
        return GenerationCut.build(call_id, self.prompt_sha, ids[:upto], lps[:upto], version)


def invalid_body(exc: ValidationError) -> web.Response:
    """A 400 in the OpenAI shape naming the first bad field."""
    err = exc.errors()[0]
    loc = ".".join(str(x) for x in err["loc"]) or "body"
    return web.json_response(error_body(f"{loc}: {err['msg']}", loc), status=400)


class CutPins:
    """Live calls by call id, the newest pin of each owner, and the two routes (``routes``)."""

    def __init__(self, stats: dict) -> None:
        self.live: dict[str, LiveCall] = {}
        self._pins: dict[str, tuple[str, dict[str, tuple[LiveCall, int]]]] = {}
        self.stats = stats  # the worker's: ``cuts`` and ``cut_tokens`` count what fetches returned
        stats.setdefault("cuts", 0)
        stats.setdefault("cut_tokens", 0)

    @property
    def routes(self) -> tuple:
        return self.handle_pin, self.handle_fetch

    @contextlib.contextmanager
    def tracking(self, call_id: str | None, live: LiveCall | None) -> Iterator[None]:
        """``live`` can be pinned under ``call_id`` until the block ends (None: an unnamed call)."""
        if call_id is None or live is None:
            yield
            return
        self.live[call_id] = live
        try:
            yield
        finally:
            if self.live.get(call_id) is live:
                del self.live[call_id]

    async def handle_pin(self, request: web.Request) -> web.Response:
        """``POST /v1/ng-cuts``: pin each named call in flight at the tokens it has decoded now (read, not
        stopped) and answer the counts; the owner's older pin is dropped."""
        try:
            req = CutRequest.model_validate_json(await request.read())
        except ValidationError as e:
            return invalid_body(e)
        pinned: dict[str, tuple[LiveCall, int]] = {}
        for call_id in req.call_ids:
            live = self.live.get(call_id)
            n = 0 if live is None else live.decoded()
            if n:
                pinned[call_id] = (live, n)
        self._pins[req.owner] = (req.pin, pinned)
        return web.Response(body=PinReply(counts={c: n for c, (_, n) in pinned.items()}).model_dump_json(),
                            content_type="application/json")

    async def handle_fetch(self, request: web.Request) -> web.Response:
        """``POST /v1/ng-cuts/fetch``: the owner's pinned cuts, each up to its pinned count; then forgotten."""
        try:
            req = FetchRequest.model_validate_json(await request.read())
        except ValidationError as e:
            return invalid_body(e)
        held = self._pins.get(req.owner)
        cuts: dict[str, GenerationCut] = {}
        if held is not None and held[0] == req.pin:
            del self._pins[req.owner]
            cuts = {call_id: live.cut(call_id, n) for call_id, (live, n) in held[1].items()}
        self.stats["cuts"] += len(cuts)
        self.stats["cut_tokens"] += sum(c.token_count for c in cuts.values())
        return web.Response(body=CutReply(cuts=cuts).model_dump_json(), content_type="application/json")
