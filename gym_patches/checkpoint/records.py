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


def check_plain_json(value: Any, where: str = "value") -> None:
    """Raise ``RecordEncodeError`` naming the path unless ``value`` is plain JSON: dicts with str
    keys, lists, str, int, finite float, bool, None (or fragments). msgspec would quietly write
    bytes as base64, sets and tuples as arrays and NaN as null; a state handed over as Python
    objects is checked with this first, so such a value fails its commit instead."""
    stack = [(value, where)]
    while stack:
        item, path = stack.pop()
        kind = type(item)
        if kind is dict:
            for key, sub in item.items():
                if type(key) is not str:
                    raise RecordEncodeError(f"{path} has a non-string key {key!r}")
                stack.append((sub, f"{path}.{key}"))
        elif kind is list:
            stack.extend((sub, f"{path}[{i}]") for i, sub in enumerate(item))
        elif kind is float:
            if item != item or item in (float("inf"), float("-inf")):
                raise RecordEncodeError(f"{path} is {item!r}, which JSON cannot carry")
        elif kind not in (str, int, bool, type(None), Fragment):
            raise RecordEncodeError(f"{path} is a {kind.__name__}, which is not plain JSON")


def decode_record(line: bytes) -> Any:
    """Parse one JSON value; ``msgspec.DecodeError`` (a ``ValueError``) if it is not valid JSON."""
    return _DECODER.decode(line)


def plain(record: dict[str, Any]) -> dict[str, Any]:
    """The record as plain Python objects (fragments parsed), as a restore will read it.
    Participants put fragments only as a record's top-level values, so only those are looked for."""
    if not any(isinstance(v, Fragment) for v in record.values()):
        return record
    return _DECODER.decode(encode_record(record))
