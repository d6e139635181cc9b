"""The reading side of a restore: the saved records of the episodes asked for, all or an error.

A restore reads its own replica's directory (``checkpoint_dir``) and, in an elastic restore, the
directories of replicas of the same shard that no longer run (``source_dirs``, docs/design.md §5.7): their
episodes continue here, so each record asked for must be in exactly one of them.
"""

from __future__ import annotations

from pydantic import ValidationError

from gym_patches.checkpoint.errors import CheckpointError
from gym_patches.checkpoint.identity import EpisodeId
from gym_patches.checkpoint.participant import Record
from gym_patches.checkpoint.store import read_participant_state
from gym_patches.checkpoint.wire import RestoreRequest


def read_selected(kind: str, instance: str, req: RestoreRequest, wanted: set[str]) -> list[Record]:
    """The saved records of ``wanted`` (blocking: run it in a thread); every one must be there, once."""
    selected: list[Record] = []
    found: dict[str, str] = {}  # capture key -> the directory its record came from
    directories = [req.checkpoint_dir, *req.source_dirs]
    for directory in directories:
        _, records = read_participant_state(directory, kind, instance, req.source_checkpoint_id)
        where = f"checkpoint {req.source_checkpoint_id!r} of {instance} in {directory}"
        for index, record in enumerate(records):
            try:
                key = EpisodeId.model_validate(record["episode_id"]).capture_key
            except (KeyError, TypeError, ValidationError):
                raise CheckpointError(f"record {index} of {where} has no valid episode_id") from None
            if key not in wanted:
                continue
            if key in found:
                raise CheckpointError(f"{key} has a record in {found[key]} and in {directory}: "
                                      f"checkpoint {req.source_checkpoint_id!r} of {instance} holds it twice")
            selected.append(record)
            found[key] = directory
    missing = sorted(wanted - set(found))
    if missing:
        where = (f"checkpoint {req.source_checkpoint_id!r} of {instance} in {req.checkpoint_dir}"
                 + (f" (or {', '.join(req.source_dirs)})" if req.source_dirs else ""))
        raise CheckpointError(f"{where} has no records for {missing[:10]} ({len(missing)} missing)")
    return selected
