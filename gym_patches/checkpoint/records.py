"""JSON encoding of checkpoint records: fast enough to run while rollouts are held.

A participant's ``export`` returns one JSON object per episode. Its large
values (an agent's loop state, a resources server's world) may be
*fragments*: a pydantic model serialised straight to JSON bytes by
pydantic-core, which is several times faster than dumping it to Python
objects and encoding those again. ``encode_record`` splices fragments in
as they are (msgspec), so a staged commit's capture is one pass over each
session. The bytes are a copy that nothing running later can change.
"""

from __future__ import annotations

from typing import Any

import msgspec
from pydantic import BaseModel

Fragment = msgspec.Raw
_ENCODER = msgspec.json.Encoder(order="sorted")  # dict keys sorted: equal records encode to equal bytes
_DECODER = msgspec.json.Decoder()


class RecordEncodeError(ValueError):
    """A record holds something JSON cannot carry."""


def fragment(model: BaseModel) -> Fragment:
    """``model`` as a JSON fragment (pydantic-core's serialiser, no Python objects in between)."""
    return msgspec.Raw(model.__pydantic_serializer__.to_json(model))


def encode_record(record: dict[str, Any]) -> bytes:
    """One JSONL line (fragments spliced in unchanged)."""
    try:
        return _ENCODER.encode(record) + b"\n"
    except (TypeError, ValueError, OverflowError) as exc:
        raise RecordEncodeError(str(exc)) from None


def decode_record(line: bytes) -> Any:
    """Parse one JSON value; ``msgspec.DecodeError`` (a ``ValueError``) if it is not valid JSON."""
    return _DECODER.decode(line)


def plain(record: dict[str, Any]) -> dict[str, Any]:
    """The record as plain Python objects (fragments parsed), as a restore will read it."""
    if not any(isinstance(v, Fragment) for v in record.values()):
        return record
    return _DECODER.decode(encode_record(record))
