"""The work of a blocking commit: export, check, write. It runs as a job of the checkpoint's
scope; the control plane admits the request and moves the phase."""

from __future__ import annotations

from gym_patches.checkpoint.control.scope import Job
from gym_patches.checkpoint.errors import CheckpointError
from gym_patches.checkpoint.participant import CheckpointParticipant, Record
from gym_patches.checkpoint.records import record_key
from gym_patches.checkpoint.storage import StorageWriter
from gym_patches.checkpoint.store import WriteStopped, write_participant_state
from gym_patches.checkpoint.wire import CommitRequest, ParticipantManifest, PrepareReport


async def export_and_write(job: Job, participant: CheckpointParticipant, instance: str, req: CommitRequest,
                           writer: StorageWriter, reported_unsaved: frozenset[str] = frozenset()
                           ) -> tuple[ParticipantManifest, list[str], dict[str, int]]:
    """Export the scope and write it (in a thread the job owns); the manifest, the keys and the
    generation cuts written (capture key -> tokens).

    A ``/run`` that reached the server after its prepared reply (``reported_unsaved`` is what that
    reply said) waits, not started: unsaved now, but unknown to the controller when it chose the
    scope. It is left out of the export, so the controller finds it not exported and restarts it
    from its prompt (docs/design.md §5.4, the drain). Computed right before the export, with no
    await between, so a run arriving meanwhile cannot slip in."""
    scope = None if req.episode_ids is None else list(req.episode_ids)
    if scope is not None:
        arrived_since = set(participant.readiness().unsaved) - reported_unsaved
        if arrived_since:
            scope = [e for e in scope if e.capture_key not in arrived_since]
    records = await participant.export(scope)
    keys = exported_keys(instance, records, None if scope is None else {e.capture_key for e in scope})
    try:
        manifest = await job.in_thread(
            write_participant_state, req.checkpoint_dir, participant.kind, instance, req.checkpoint_id, records,
            writer=writer, should_stop=job.stop.is_set,
        )
    except WriteStopped:
        raise CheckpointError(f"commit for {req.checkpoint_id!r} was aborted", code="stale_checkpoint") from None
    return manifest, keys, cut_tokens_of(records)


def cut_tokens_of(records: list[Record]) -> dict[str, int]:
    """capture key -> tokens of each record that carries a generation cut (``cut_tokens`` > 0)."""
    out: dict[str, int] = {}
    for record in records:
        tokens = record.get("cut_tokens") if type(record) is dict else None
        if type(tokens) is int and tokens > 0:
            key = record_key(record)
            if key is not None:
                out[key] = tokens
    return out


def refuse_unready(instance: str, report: PrepareReport, scope: tuple[str, ...] | None,
                   reported_unsaved: frozenset[str]) -> None:
    """A commit needs the participant still ready and no episode its prepared reply called unsaved in
    its scope (the controller was told: a bug on its side)."""
    if not report.ready:
        raise CheckpointError(f"{instance} is no longer ready (blockers: {report.blockers})", code="invalid_phase")
    in_scope = sorted(reported_unsaved if scope is None else reported_unsaved.intersection(scope))
    if in_scope:
        raise CheckpointError(
            f"{instance} cannot save {in_scope[:10]} ({len(in_scope)} unsaved in scope); "
            "commit only the continued episodes",
            code="restart_in_scope",
        )


def exported_keys(instance: str, records: list[Record], scope: set[str] | None) -> list[str]:
    """Each record's capture key; a record without one, or outside the scope, fails the commit."""
    keys: list[str] = []
    for index, record in enumerate(records):
        key = record_key(record)
        if key is None:
            raise CheckpointError(f"{instance} exported record {index} without a valid episode_id")
        if scope is not None and key not in scope:
            raise CheckpointError(f"{instance} exported {key!r}, which is outside the commit scope")
        keys.append(key)
    return keys
