"""Generation cuts: the tokens a model call has decoded so far, saved so a restore continues it.

One definition of the wire, used by Gym's model server (the client) and by any
generation backend that supports cuts (the server; NeMo-RL's torch and vLLM
workers):

* The model server sends each backend call with the header ``X-NG-Call-Id``, and with
  ``X-NG-Call-Index``: the call's index within its episode (a backend's deterministic sampling seeds
  from it; Gym knows nothing of what it means). A call it sends again
  because the backend could not be reached (a generation worker lost and restarted under it) keeps its
  call id, carries the newest cut of itself it holds as ``ng_prefix`` (if any), and the header
  ``X-NG-Resend`` (the number of the resend), so the backend can count what came back to it.
* The cut has two halves. As admission closes the model server sends
  ``POST <policy_base_url>/ng-cuts`` with a ``CutRequest`` (without waiting for
  it there): the backend *pins* the named calls at the tokens each has decoded
  and answers only those counts (``PinReply``). Decoded tokens never change,
  so after resume ``POST <policy_base_url>/ng-cuts/fetch`` (``FetchRequest``)
  returns each pinned call's ``GenerationCut`` up to its pinned count
  (``CutReply``), also for calls that have finished since. Any prefix of a
  call's own tokens is a valid cut (the restored call decodes the rest again),
  so the pin may land a round trip after admission closed. A backend keeps the
  newest pin of each owner (model server) until it is fetched or replaced.
  Neither request stops or alters a call. A backend without the routes
  answers 404: no cut support.
* A chat-completions body may carry ``ng_prefix``: a saved ``GenerationCut``.
  The backend checks its digests, renders the prompt, and if the prompt's
  token ids are those the cut was taken after, continues decoding after the
  prefix with the budget reduced by its length; the reply is prefix + tail as
  one message and says so in ``prefix_continuation``. A cut that does not
  match is discarded (the call is generated from its start), never continued.

Tokens travel packed (int32 / float64, little-endian, base64), so a cut of
hundreds of calls of hundreds of tokens is a few strings, cheap to take while
rollouts are held; the records keep them as they came.
"""

from __future__ import annotations

import base64
import hashlib
import sys
from array import array
from typing import Iterable, Literal

from pydantic import BaseModel, ConfigDict, Field

CALL_ID_HEADER = "X-NG-Call-Id"
RESEND_HEADER = "X-NG-Resend"  # on a call sent again after the backend was unreachable: 1, 2, ...
# The call's index within its episode: the replies the episode was delivered when the call was made (a restored
# episode counts on from its record), so the same call of the same rollout has the same index on every attempt.
CALL_INDEX_HEADER = "X-NG-Call-Index"
CUT_ROUTE = "/ng-cuts"  # appended to the backend's base URL (``.../v1``): pin
CUT_FETCH_ROUTE = "/ng-cuts/fetch"  # ... and fetch
PREFIX_FIELD = "ng_prefix"  # the chat-completions body field that carries a cut to continue
CALL_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,159}$"
_HEX64 = r"^[0-9a-f]{64}$"
DiscardReason = Literal["prompt_mismatch", "corrupt", "budget_exhausted"]


def _packed(values: Iterable, code: str) -> bytes:
    arr = array(code, values)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def _unpacked(raw: bytes, code: str) -> list:
    arr = array(code)
    arr.frombytes(raw)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tolist()


def prompt_digest(prompt_token_ids: Iterable[int]) -> str:
    """sha256 of a prompt's token ids (int32 LE): what a continuation's rendered prompt must equal."""
    return hashlib.sha256(_packed(prompt_token_ids, "i")).hexdigest()


def _content_digest(prompt_sha: str, tokens: bytes, logprobs: bytes) -> str:
    h = hashlib.sha256(prompt_sha.encode())
    h.update(len(tokens).to_bytes(8, "little"))
    h.update(tokens)
    h.update(logprobs)
    return h.hexdigest()


class GenerationCut(BaseModel):
    """One call's decoded tokens at the moment of the cut (a record fragment and a wire body)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    call_id: str = Field(pattern=CALL_ID_PATTERN)
    prompt_digest: str = Field(pattern=_HEX64)
    token_ids: str  # base64 of int32 LE
    log_probs: str  # base64 of float64 LE
    token_count: int = Field(ge=1)
    weight_version: int = Field(ge=0)  # the version that sampled the first token (the oldest)
    digest: str = Field(pattern=_HEX64)  # over prompt_digest, token ids and logprobs

    @classmethod
    def build(cls, call_id: str, prompt_sha: str, token_ids: list[int], log_probs: list[float],
              weight_version: int) -> "GenerationCut":
        n = min(len(token_ids), len(log_probs))
        tokens, lps = _packed(token_ids[:n], "i"), _packed(log_probs[:n], "d")
        return cls.model_construct(
            call_id=call_id, prompt_digest=prompt_sha,
            token_ids=base64.b64encode(tokens).decode(), log_probs=base64.b64encode(lps).decode(),
            token_count=n, weight_version=int(weight_version), digest=_content_digest(prompt_sha, tokens, lps))

    def unpack(self) -> tuple[list[int], list[float]]:
        """The token ids and logprobs; ``ValueError`` naming what is wrong if they do not match the digest
        or the count (a torn or altered record is never continued)."""
        try:
            tokens = base64.b64decode(self.token_ids, validate=True)
            lps = base64.b64decode(self.log_probs, validate=True)
        except ValueError as exc:
            raise ValueError(f"cut {self.call_id}: token_ids/log_probs are not base64: {exc}") from None
        if _content_digest(self.prompt_digest, tokens, lps) != self.digest:
            raise ValueError(f"cut {self.call_id}: digest does not match its tokens")
        ids, logprobs = _unpacked(tokens, "i"), _unpacked(lps, "d")
        if not (len(ids) == len(logprobs) == self.token_count):
            raise ValueError(f"cut {self.call_id}: token_count {self.token_count} but {len(ids)} token ids "
                             f"and {len(logprobs)} logprobs")
        return ids, logprobs


class CutRequest(BaseModel):
    """Pin the named calls under ``pin``; the owner's older pin is dropped."""

    model_config = ConfigDict(extra="forbid")

    owner: str = Field(min_length=1, max_length=200)  # the model server (one pin kept per owner)
    pin: str = Field(min_length=1, max_length=200)
    call_ids: list[str] = Field(min_length=1, max_length=100_000)


class PinReply(BaseModel):
    """Tokens decoded now by each named call the backend is decoding with at least one; others left out."""

    model_config = ConfigDict(extra="forbid")

    counts: dict[str, int] = Field(default_factory=dict)


class FetchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    owner: str = Field(min_length=1, max_length=200)
    pin: str = Field(min_length=1, max_length=200)


class CutReply(BaseModel):
    """The pinned calls' cuts, each up to its pinned count (a pin not held, or replaced: empty)."""

    model_config = ConfigDict(extra="forbid")

    cuts: dict[str, GenerationCut] = Field(default_factory=dict)


class PrefixContinuation(BaseModel):
    """The reply extension of a call sent with ``ng_prefix``: which cut, and whether it continued."""

    model_config = ConfigDict(extra="forbid")

    call_id: str
    token_count: int = Field(ge=0)  # prefix tokens reused (0 when discarded)
    digest: str
    discarded: DiscardReason | None = None


class CutSummary(BaseModel):
    """What a model server's cut noted at prepare (``PrepareReply.cut``); the tokens come after resume,
    and what could not be had then is in ``PersistReply.cut_failed`` / ``cut_error``."""

    model_config = ConfigDict(extra="forbid")

    in_flight: int = Field(default=0, ge=0)  # tracked calls generating when admission closed
    error: str | None = None  # why none can be cut (no cut support): every such call regenerates at turn level
