"""The capture of a staged snapshot: taken at prepare, written by ``persist`` after resume.

A ``capture`` prepare copies every exportable session's record the moment the participant is
prepared (``take_capture``); ``persist`` writes a scope's records from that copy later, so nothing
running after resume can change what is written. Only the newest capture is kept; it owns its
persist write (``tasks``), which a newer capture or the server's stop closes.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any, Awaitable, Callable

from gym_patches.checkpoint.control.scope import Job, TaskScope
from gym_patches.checkpoint.errors import CheckpointError, CheckpointStoreError
from gym_patches.checkpoint.identity import EpisodeId
from gym_patches.checkpoint.participant import CheckpointParticipant, Record
from gym_patches.checkpoint.records import CapturedRecord, RecordEncodeError, encode_record, frozen_copy, record_key
from gym_patches.checkpoint.storage import StorageWriter
from gym_patches.checkpoint.store import EncodedRecords, WriteStopped, write_participant_state
from gym_patches.checkpoint.wire import ParticipantManifest, PersistReply, dump


_KEY = itemgetter(0)  # CapturedRecord.key
_SIZE = itemgetter(2)  # CapturedRecord.size

# A key's captured records: one ``CapturedRecord`` as a participant kept it, or a list of records (an
# immutable record as it is, any other already encoded).
Entry = CapturedRecord | list[Record | bytes]


class StagedCapture:
    """Every exportable session's record by capture key (an immutable record as it is, any other
    already encoded), the keys reported unsaved at prepare, and the persist write it owns."""

    def __init__(self, instance: str, checkpoint_id: str, entries: dict[str, Entry], nbytes: int,
                 fill: Callable[[EpisodeId], Record | None] | None, unsaved: frozenset[str],
                 complete: Callable[[], Awaitable[tuple[dict[str, Record], int, str | None]]] | None = None):
        self.checkpoint_id = checkpoint_id
        self.keys = sorted(entries)
        self.nbytes = nbytes
        self.unsaved = unsaved
        self.tasks = TaskScope(f"capture {checkpoint_id!r}", instance)
        self._entries: dict[str, Entry] | None = entries  # None once written
        self._fill = fill
        self._complete = complete  # fields some records gain after resume (the model's cuts)

    def persist(self, kind: str, instance: str, checkpoint_dir: str, scope: tuple[str, ...],
                writer: StorageWriter) -> Job[dict[str, Any]]:
        """The write of ``scope`` to ``checkpoint_dir`` through ``writer``: started by the first call (which fixes the
        arguments), shared by every retry. Caller holds the control plane's lock."""
        args = (checkpoint_dir, scope)
        job = self.tasks.get("persist")
        if job is not None:
            if job.args != args:
                raise CheckpointError(f"persist for {self.checkpoint_id!r} was already asked with other arguments",
                                      code="checkpoint_conflict")
            return job
        in_scope = sorted(self.unsaved.intersection(scope))
        if in_scope:
            raise CheckpointError(
                f"{instance} cannot save {in_scope[:10]} ({len(in_scope)} unsaved in scope); "
                "persist only the continued episodes",
                code="restart_in_scope",
            )

        async def write(job: Job[dict[str, Any]]) -> dict[str, Any]:
            # no lock: it changes only this capture (freed once written), which nothing else writes
            late, cut_failed, cut_error = await self._complete() if self._complete is not None else ({}, 0, None)
            try:
                keys, manifest, cut_tokens = await job.in_thread(self._write, checkpoint_dir, kind, instance,
                                                                 scope, writer, job.stop.is_set, late)
            except WriteStopped:
                raise CheckpointError(f"persist for {self.checkpoint_id!r} was aborted",
                                      code="stale_checkpoint") from None
            return dump(PersistReply(manifest=manifest, episode_ids=keys, cut_tokens=cut_tokens,
                                     cut_failed=cut_failed, cut_error=cut_error))

        return self.tasks.spawn("persist", f"persist for {self.checkpoint_id!r}", args, write)

    def select(self, scope: tuple[str, ...], late: dict[str, Record] | None = None
               ) -> tuple[list[str], EncodedRecords, dict[str, int]]:
        """The scope's records as JSONL lines (in key order), the keys that have any, and the
        generation cuts among them (capture key -> tokens). ``late``: fields a key's record gains."""
        late = late or {}
        assert self._entries is not None, f"the capture of {self.checkpoint_id!r} was already written"
        keys: list[str] = []
        lines: list[bytes] = []
        cut_tokens: dict[str, int] = {}
        for key in scope:
            found = self._entries.get(key)
            if type(found) is CapturedRecord:
                found = [found.record]
            elif found is None and self._fill is not None:
                record = self._fill(EpisodeId.from_capture_key(key))
                found = None if record is None else [record]
            if not found:
                continue
            keys.append(key)
            for entry in found:
                if type(entry) is bytes:
                    lines.append(entry)
                    continue
                if key in late:
                    entry = {**entry, **late[key]}
                tokens = entry.get("cut_tokens")
                if type(tokens) is int and tokens > 0:
                    cut_tokens[key] = tokens
                try:
                    lines.append(encode_record(entry))
                except RecordEncodeError as exc:
                    raise CheckpointStoreError(f"the record of {key} is not JSON-serialisable: {exc}") from None
        return keys, EncodedRecords(lines), cut_tokens

    def _write(self, checkpoint_dir: str, kind: str, instance: str, scope: tuple[str, ...], writer: StorageWriter,
               should_stop: Callable[[], bool], late: dict[str, Record] | None = None,
               ) -> tuple[list[str], ParticipantManifest, dict[str, int]]:
        """Select and write the scope (blocking: runs in the job's thread), then free the copy."""
        keys, encoded, cut_tokens = self.select(scope, late)
        manifest = write_participant_state(checkpoint_dir, kind, instance, self.checkpoint_id, encoded,
                                           writer=writer, should_stop=should_stop)
        self._entries = None  # written: retries get the stored reply
        return keys, manifest, cut_tokens


class NewestCapture:
    """The one capture kept: a newer one replaces it, closing the older one's persist write."""

    def __init__(self) -> None:
        self._staged: StagedCapture | None = None

    def of(self, checkpoint_id: str) -> StagedCapture:
        staged = self._staged
        if staged is None or staged.checkpoint_id != checkpoint_id:
            raise CheckpointError(f"nothing captured for checkpoint {checkpoint_id!r} (a newer capture replaced "
                                  "it, or its prepare did not capture)", code="stale_checkpoint")
        return staged

    async def replace(self, captured: StagedCapture) -> None:
        older, self._staged = self._staged, captured
        if older is not None:  # its write, if still running, stops before it publishes
            await older.tasks.close("a newer capture")

    async def close(self, reason: str) -> None:
        staged, self._staged = self._staged, None
        if staged is not None:
            await staged.tasks.close(reason)


async def take_capture(participant: CheckpointParticipant, instance: str, checkpoint_id: str,
                       unsaved: list[str]) -> StagedCapture:
    """Copy every exportable session's record now, while everything is held (on the loop: a
    thread would only wait on the GIL). A record of immutable values is kept as it is (its
    fragments are already bytes) and encoded by ``persist``; any other is encoded here. A
    ``CapturedRecord`` is that work done by the participant when its session came to rest. A
    record without a valid episode_id fails the prepare."""
    records: list[Any] = await participant.capture_records()
    fill = participant.scope_fill()
    complete = participant.capture_completion()
    if not records or set(map(type, records)) == {CapturedRecord}:
        # The common case (every saving participant): one record per key, already checked and copied.
        # Keyed as they are, in C-level passes: this runs while every rollout is held, and at N = 8192
        # a Python loop making a list per key cost a few ms per participant (docs/design.md §5.4).
        keyed: dict[str, CapturedRecord] = dict(zip(map(_KEY, records), records))
        if len(keyed) == len(records):
            return StagedCapture(instance, checkpoint_id, keyed, sum(map(_SIZE, records)), fill,
                                 frozenset(unsaved), complete)
    entries: dict[str, list[Record | bytes]] = {}
    nbytes = 0
    for index, record in enumerate(records):
        if type(record) is CapturedRecord:  # checked and frozen by the participant, maybe long ago
            key, kept, size = record
            entries.setdefault(key, []).append(kept)
            nbytes += size
            continue
        key = record_key(record)
        if key is None:
            raise CheckpointError(f"{instance} exported record {index} without a valid episode_id")
        kept, size = frozen_copy(record)
        if kept is None:
            try:
                kept = encode_record(record)
            except RecordEncodeError as exc:
                raise CheckpointError(f"{instance} cannot capture record {index} ({key}): {exc}") from None
            size = len(kept)
        nbytes += size
        entries.setdefault(key, []).append(kept)
    return StagedCapture(instance, checkpoint_id, entries, nbytes, fill, frozenset(unsaved), complete)
