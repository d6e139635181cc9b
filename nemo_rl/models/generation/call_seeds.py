"""Deterministic sampling (``grpo.deterministic``, docs/design.md §5.13): each model call's seed, and its
draws by counter.

A call's tokens must depend on its request and on nothing that timing or a fault can change: not on the
calls decoded before it, the batch it shared, a worker restart, or which attempt of its rollout made it.
So the worker derives a seed per call from three things (``call_seed``):

* the run's ``grpo.seed``;
* the rollout's identity: prompt group and sibling index (``{group}_g{i}``), read from the call id Gym's
  model server sends (``X-NG-Call-Id: <capture key>.<random>``; RL's rollout ids are
  ``{group}_g{i}_a{uuid}`` plus ``-a{N}`` for Gym attempt N > 0, docs/design.md §5.3): the ledger
  attempt and the Gym attempt are left out, so a rollout restarted from its prompt or restored from a
  snapshot draws what the first attempt drew;
* the call's index within its episode (``X-NG-Call-Index``, which the model server counts and a restored
  episode continues from its record, gym_patches/checkpoint/cuts.py).

A call without them (a plain ``/v1/responses`` call, a client other than Gym) is seeded by its prompt.

The draw of the call's token ``t`` is a function of (seed, t) alone (``uniform``), not the state of a
generator that earlier tokens advanced: a call continued after a generation cut of k tokens
(``target_level: prefix``, docs/design.md §5.10) draws token k exactly as the uninterrupted decode
would. A token is chosen from the step's probabilities by the inverse of their cumulative sum in float64
(``token_at``): given the same probabilities, the same token.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass

import torch

from gym_patches.checkpoint.cuts import CALL_INDEX_HEADER, prompt_digest

_RL_ROLLOUT = re.compile(r"^(?P<identity>.+_g[0-9]+)_a[0-9a-f]+$")
_GYM_ATTEMPT = re.compile(r"^(?P<base>.+)-a[0-9]+$")
_SEED_TAG = b"nemo-rl/call-seed/v1"
_DRAW_TAG = b"nemo-rl/draw/v1"


def rollout_identity(call_id: str) -> str:
    """The rollout a call id belongs to, without its attempts: ``s3p17_g2_a<uuid>-a1.<rand>`` ->
    ``s3p17_g2``. An id of another shape keeps its capture key, less a Gym attempt suffix."""
    capture_key = call_id.rsplit(".", 1)[0]
    m = _GYM_ATTEMPT.match(capture_key)
    base = m["base"] if m else capture_key
    m = _RL_ROLLOUT.match(base)
    return m["identity"] if m else base


def call_seed(run_seed: int, identity: str, call_index: int) -> int:
    """The seed of call ``call_index`` of rollout ``identity`` in a run seeded ``run_seed`` (63 bits)."""
    h = hashlib.sha256(b"\0".join([_SEED_TAG, str(int(run_seed)).encode(), identity.encode(),
                                   str(int(call_index)).encode()]))
    return int.from_bytes(h.digest()[:8], "little") >> 1


def parse_call_index(value: str | None) -> int | None:
    """The ``X-NG-Call-Index`` header as an int (None when absent); ``ValueError`` naming the header."""
    if value is None:
        return None
    if not value.isdigit() or len(value) > 9:
        raise ValueError(f"{CALL_INDEX_HEADER}: {value[:40]!r} is not a call index (a non-negative integer)")
    return int(value)


def request_seed(run_seed: int, call_id: str | None, call_index: int | None, request_key: str) -> int:
    """The seed of one request: from its rollout and index when Gym names them, else from ``request_key``
    (a digest of what it asks: ``prompt_key``)."""
    if call_id is not None and call_index is not None:
        return call_seed(run_seed, rollout_identity(call_id), call_index)
    return call_seed(run_seed, "request:" + request_key, 0)


def prompt_key(prompt_ids: list[int]) -> str:
    """A request's key for ``request_seed`` by its prompt's token ids."""
    return prompt_digest(prompt_ids)


def messages_key(messages: object) -> str:
    """A request's key for ``request_seed`` by its messages (a backend that does not render the prompt)."""
    return hashlib.sha256(json.dumps(messages, sort_keys=True, default=str).encode()).hexdigest()


def offset_seed(seed: int, offset: int) -> int:
    """A seed for decoding a call from its token ``offset`` on, for a backend that cannot draw by counter
    (vLLM): reproducible for the same cut, but not the draws the uninterrupted call made."""
    return call_seed(seed, "offset", offset)


def uniform(seed: int, t: int) -> float:
    """The draw for token ``t`` of the call seeded ``seed``: uniform in [0, 1), 53 bits, by counter."""
    h = hashlib.blake2b(struct.pack("<QQ", seed & (2**64 - 1), t), digest_size=8, person=_DRAW_TAG[:16])
    return (int.from_bytes(h.digest(), "little") >> 11) * (1.0 / (1 << 53))


def token_at(logprobs: torch.Tensor, u: float) -> int:
    """The token whose interval of the cumulative distribution (``exp(logprobs)``, summed in float64)
    holds ``u``: a sample of the distribution for ``u`` uniform, and a function of (logprobs, u) only."""
    cdf = torch.cumsum(logprobs.detach().to("cpu", torch.float64).exp(), dim=-1)
    x = torch.tensor([u * float(cdf[-1])], dtype=torch.float64)
    return min(int(torch.searchsorted(cdf, x, right=True)[0]), cdf.numel() - 1)


@dataclass(frozen=True)
class CallDraws:
    """The draws of one call: its seed, and how many of its tokens came before this decode (a prefix)."""

    seed: int
    offset: int = 0

    def u(self, decoded: int) -> float:
        """The draw for the next token when ``decoded`` tokens of this decode are done."""
        return uniform(self.seed, self.offset + decoded)
