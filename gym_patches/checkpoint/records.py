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

from typing import Any, NamedTuple

import msgspec
from pydantic import BaseModel

from gym_patches.checkpoint.identity import checked_capture_key

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


def _fragments(value: Any) -> bool:
    """A fragment, or a tuple of fragments (the model's recorded calls)."""
    kind = type(value)
    return kind is Fragment or (kind is tuple and all(type(v) is Fragment for v in value))


def plain(record: dict[str, Any]) -> dict[str, Any]:
    """The record as plain Python objects (fragments parsed), as a restore will read it.
    Participants put fragments only as a record's top-level values (alone, or a tuple of them), so
    only those are looked for."""
    if not any(_fragments(v) for v in record.values()):
        return record
    return _DECODER.decode(encode_record(record))


_SCALARS = frozenset({int, float, bool, type(None)})


def frozen_copy(record: dict[str, Any]) -> tuple[dict[str, Any] | None, int]:
    """A copy of ``record`` that nothing running later can change, if one is cheap, and about the
    size of its JSON line (exact for strings and fragments, 12 bytes per name and number besides).
    Cheap: its ``episode_id`` (checked by the caller) rebuilt and every other value immutable (a
    string, number, bool, None, JSON fragment or tuple of fragments), so encoding it can wait. ``(None, 0)``: some value
    could still change (a state given as Python objects); encode that record at once instead."""
    copy: dict[str, Any] = {}
    size = 0
    for name, value in record.items():
        kind = type(value)
        if kind is Fragment or kind is str:
            size += len(value)
        elif kind is tuple and all(type(v) is Fragment for v in value):
            size += sum(map(len, value)) + len(value)
        elif name == "episode_id":
            value = {"rollout_id": value["rollout_id"], "attempt": value["attempt"]}
            size += len(value["rollout_id"]) + 40
        elif kind not in _SCALARS:
            return None, 0
        copy[name] = value
        size += len(name) + 12
    return copy, size


class CapturedRecord(NamedTuple):
    """A record checked and copied for a staged capture: its capture key, a copy of immutable values
    that nothing later changes, and about its JSON size. Made by ``capture_record``; a participant
    may keep one per session that has not moved and hand it to every capture, which then does no
    work for that session."""

    key: str
    record: dict[str, Any]
    size: int


def record_key(record: Any) -> str | None:
    """The record's capture key if its ``episode_id`` is plainly a valid one; None otherwise."""
    return checked_capture_key(record.get("episode_id")) if type(record) is dict else None


def capture_record(record: dict[str, Any]) -> CapturedRecord | None:
    """``record`` checked (a valid ``episode_id``) and frozen; None if it cannot be (no valid
    episode id, or a value that could still change)."""
    key = record_key(record)
    if key is None:
        return None
    copy, size = frozen_copy(record)
    return None if copy is None else CapturedRecord(key, copy, size)
