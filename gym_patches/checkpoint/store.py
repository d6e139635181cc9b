"""On-disk state of one participant for one checkpoint (docs/design.md §4.7).

Layout: ``<checkpoint_dir>/gym/<kind>/<instance>/records-<sha256>.jsonl`` plus a
write-once ``manifest.json``. The records file is named by its digest, so a
torn write can never pass for a finished one; the manifest is committed with
``replace=False`` (``os.link`` for plain files) so it is created exactly once and never replaced. Reading checks
every manifest field and the digest, and every error names the file.

Every file's bytes, its rename and the directory it lands in go through the
``StorageWriter`` the caller passes (``gym_patches.checkpoint.storage``): a test
passes one that fails like a full disk. Reads are plain file reads.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import uuid
from pathlib import Path
from typing import Any, Callable, get_args

from pydantic import ValidationError

from gym_patches.checkpoint.errors import CheckpointStoreError
from gym_patches.checkpoint.records import RecordEncodeError, decode_record, encode_record
from gym_patches.checkpoint.storage import StorageWriter
from gym_patches.checkpoint.wire import CHECKPOINT_ID_PATTERN, ParticipantKind, ParticipantManifest

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
_KINDS = frozenset(get_args(ParticipantKind))
_CHECKPOINT_ID = re.compile(CHECKPOINT_ID_PATTERN)
_SEGMENT = re.compile(r"^[A-Za-z0-9_.@+=:-]{1,200}$")


class WriteStopped(CheckpointStoreError):
    """The caller asked the write to stop before it was published."""


def participant_dir(checkpoint_dir: str | os.PathLike[str], kind: str, instance: str) -> Path:
    """``<checkpoint_dir>/gym/<kind>/<instance>``; refuses anything that could escape it."""
    if kind not in _KINDS:
        raise CheckpointStoreError(f"unknown participant kind {kind!r} (expected one of {sorted(_KINDS)})")
    if not isinstance(instance, str) or not instance:
        raise CheckpointStoreError(f"instance name {instance!r} must be a non-empty string")
    if instance.startswith("/") or "\\" in instance:
        raise CheckpointStoreError(f"instance name {instance!r} must be a relative path")
    for segment in instance.split("/"):
        if segment in ("", ".", "..") or not _SEGMENT.match(segment):
            raise CheckpointStoreError(
                f"instance name {instance!r} has an unsafe path segment {segment!r} "
                f"(segments must match {_SEGMENT.pattern} and not be '.' or '..')"
            )
    if not str(checkpoint_dir):
        raise CheckpointStoreError("checkpoint_dir must not be empty")
    return Path(checkpoint_dir) / "gym" / kind / instance


def _check_checkpoint_id(checkpoint_id: str) -> None:
    if not isinstance(checkpoint_id, str) or not _CHECKPOINT_ID.match(checkpoint_id):
        raise CheckpointStoreError(f"checkpoint_id {checkpoint_id!r} must match {CHECKPOINT_ID_PATTERN}")


def _stop_if(should_stop: Callable[[], bool] | None, where: Path) -> None:
    if should_stop is not None and should_stop():
        raise WriteStopped(f"write of {where} stopped before it was published")


class EncodedRecords:
    """Records serialised to JSONL lines: a copy that nothing running later can change (only the
    store holds it). One bytes object per record, so capturing copies each record once and never
    regrows a buffer; the digest is taken when first asked for: by the write, after resume."""

    def __init__(self, lines: list[bytes]):
        self.lines = lines
        self.count = len(lines)
        self.nbytes = sum(len(line) for line in lines)

    @functools.cached_property
    def sha256(self) -> str:
        digest = hashlib.sha256()
        for line in self.lines:
            digest.update(line)
        return digest.hexdigest()


def encode_records(records: list[dict[str, Any]], *, should_stop: Callable[[], bool] | None = None,
                   where: Path | None = None) -> EncodedRecords:
    """Serialise ``records`` to JSONL (the capture half of a staged commit: CPU only, no I/O).

    Values may be JSON fragments (``records.fragment``), spliced in as they are.
    ``should_stop`` is checked between records (``WriteStopped``)."""
    lines: list[bytes] = []
    for index, record in enumerate(records):
        if should_stop is not None:
            _stop_if(should_stop, where or Path("."))
        if not isinstance(record, dict):
            raise CheckpointStoreError(f"record {index} is a {type(record).__name__}, expected a JSON object")
        try:
            lines.append(encode_record(record))
        except RecordEncodeError as exc:
            raise CheckpointStoreError(f"record {index} is not JSON-serialisable: {exc}") from None
    return EncodedRecords(lines)


def write_participant_state(
    checkpoint_dir: str | os.PathLike[str],
    kind: str,
    instance: str,
    checkpoint_id: str,
    records: list[dict[str, Any]] | EncodedRecords,
    *,
    writer: StorageWriter,
    should_stop: Callable[[], bool] | None = None,
) -> ParticipantManifest:
    """Write ``records`` (or records encoded earlier) and publish the manifest once, all through
    ``writer`` (the files, their renames, the directory).

    Identical content committed again returns the existing manifest; other
    content for an existing manifest is an error. ``should_stop`` (checked
    before each rename) lets a resume abandon a write that is not yet
    published; it then raises ``WriteStopped``.
    """
    _check_checkpoint_id(checkpoint_id)
    directory = participant_dir(checkpoint_dir, kind, instance)
    try:
        writer.make_dirs(directory)
    except OSError as exc:
        raise CheckpointStoreError(f"cannot create {directory}: {exc}") from None
    encoded = records if isinstance(records, EncodedRecords) else encode_records(
        records, should_stop=should_stop, where=directory)
    manifest_path = directory / MANIFEST_NAME
    tmp = directory / f".records.jsonl-{uuid.uuid4().hex}.tmp"
    target = directory / f"records-{encoded.sha256}.jsonl"  # the file a failed write names
    try:
        _stop_if(should_stop, directory)
        writer.write(tmp, b"".join(encoded.lines))
        manifest = ParticipantManifest(
            kind=kind,  # type: ignore[arg-type]
            instance=instance,
            checkpoint_id=checkpoint_id,
            records_file=f"records-{encoded.sha256}.jsonl",
            records_sha256=encoded.sha256,
            record_count=encoded.count,
        )
        if manifest_path.exists():
            existing = _same_or_raise(manifest_path, manifest)
            if not (directory / manifest.records_file).exists():  # repair a lost records file
                writer.commit(tmp, directory / manifest.records_file)
            return existing
        _stop_if(should_stop, directory)
        writer.commit(tmp, directory / manifest.records_file)
        _stop_if(should_stop, directory)
        target = manifest_path
        return _publish_manifest(manifest_path, manifest, writer)
    except OSError as exc:
        why = f"[Errno {exc.errno}] {exc.strerror}" if exc.errno is not None else str(exc)
        raise CheckpointStoreError(f"cannot write {target}: {why}") from None
    finally:
        writer.remove(tmp)  # a temporary left by a failure (none once committed)


def _publish_manifest(path: Path, manifest: ParticipantManifest, writer: StorageWriter) -> ParticipantManifest:
    tmp = path.parent / f".manifest.json-{uuid.uuid4().hex}.tmp"
    try:
        writer.write(tmp, json.dumps(manifest.model_dump(mode="json"), sort_keys=True, indent=1).encode() + b"\n")
        try:
            writer.commit(tmp, path, replace=False)  # created exactly once, never replaced
        except FileExistsError:
            return _same_or_raise(path, manifest)
        return manifest
    finally:
        writer.remove(tmp)  # a temporary left by a failure (none once committed)


def _same_or_raise(path: Path, manifest: ParticipantManifest) -> ParticipantManifest:
    existing = _load_manifest(path)
    if existing.checkpoint_id != manifest.checkpoint_id:
        raise CheckpointStoreError(
            f"{path} already belongs to checkpoint {existing.checkpoint_id!r}; "
            f"checkpoint {manifest.checkpoint_id!r} needs its own checkpoint_dir"
        )
    if existing != manifest:
        raise CheckpointStoreError(
            f"{path} already records different content for checkpoint {manifest.checkpoint_id!r} "
            f"(existing {existing.records_sha256}, {existing.record_count} records; "
            f"new {manifest.records_sha256}, {manifest.record_count} records)"
        )
    return existing


def _load_manifest(path: Path) -> ParticipantManifest:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointStoreError(f"{path} is missing") from None
    except OSError as exc:
        raise CheckpointStoreError(f"cannot read {path}: {exc}") from None
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointStoreError(f"{path} is not valid JSON (truncated or corrupt): {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointStoreError(f"{path} must hold a JSON object")
    if data.get("schema_version") != SCHEMA_VERSION:
        raise CheckpointStoreError(
            f"{path} has schema_version {data.get('schema_version')!r}, expected {SCHEMA_VERSION}"
        )
    try:
        return ParticipantManifest.model_validate(data)
    except ValidationError as exc:
        fields = "; ".join(f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in exc.errors())
        raise CheckpointStoreError(f"{path} is not a valid manifest: {fields}") from None


def read_participant_state(
    checkpoint_dir: str | os.PathLike[str], kind: str, instance: str, checkpoint_id: str,
) -> tuple[ParticipantManifest, list[dict[str, Any]]]:
    """Load and verify one participant's records; any mismatch raises naming the file."""
    _check_checkpoint_id(checkpoint_id)
    directory = participant_dir(checkpoint_dir, kind, instance)
    manifest_path = directory / MANIFEST_NAME
    manifest = _load_manifest(manifest_path)
    for field, expected in (("kind", kind), ("instance", instance), ("checkpoint_id", checkpoint_id)):
        if getattr(manifest, field) != expected:
            raise CheckpointStoreError(
                f"{manifest_path} has {field} {getattr(manifest, field)!r}, expected {expected!r}"
            )
    if manifest.records_file != f"records-{manifest.records_sha256}.jsonl":
        raise CheckpointStoreError(
            f"{manifest_path} names records file {manifest.records_file!r}, "
            f"which does not match records_sha256 {manifest.records_sha256}"
        )
    records_path = directory / manifest.records_file
    digest = hashlib.sha256()
    records: list[dict[str, Any]] = []
    problem: str | None = None
    try:
        with open(records_path, "rb") as src:
            for number, line in enumerate(src, start=1):
                digest.update(line)
                if problem is not None:
                    continue
                try:
                    value = decode_record(line)
                except ValueError as exc:
                    problem = f"line {number} is not valid JSON: {exc}"
                    continue
                if not isinstance(value, dict):
                    problem = f"line {number} is not a JSON object"
                    continue
                records.append(value)
    except FileNotFoundError:
        raise CheckpointStoreError(f"{records_path} is missing (named by {manifest_path})") from None
    except OSError as exc:
        raise CheckpointStoreError(f"cannot read {records_path}: {exc}") from None
    if digest.hexdigest() != manifest.records_sha256:
        raise CheckpointStoreError(
            f"{records_path} has sha256 {digest.hexdigest()}, but {manifest_path} says {manifest.records_sha256}"
        )
    if problem is not None:
        raise CheckpointStoreError(f"{records_path}: {problem}")
    if len(records) != manifest.record_count:
        raise CheckpointStoreError(
            f"{records_path} holds {len(records)} records, but {manifest_path} says {manifest.record_count}"
        )
    return manifest, records
