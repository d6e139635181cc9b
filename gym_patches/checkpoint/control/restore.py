"""The reading side of a restore: the saved records of the episodes asked for, all or an error."""

from __future__ import annotations

from pydantic import ValidationError

from gym_patches.checkpoint.errors import CheckpointError
from gym_patches.checkpoint.identity import EpisodeId
from gym_patches.checkpoint.participant import Record
from gym_patches.checkpoint.store import read_participant_state
from gym_patches.checkpoint.wire import RestoreRequest


def read_selected(kind: str, instance: str, req: RestoreRequest, wanted: set[str]) -> list[Record]:
    """The saved records of ``wanted`` (blocking: run it in a thread); every one must be there."""
    _, records = read_participant_state(req.checkpoint_dir, kind, instance, req.source_checkpoint_id)
    where = f"checkpoint {req.source_checkpoint_id!r} of {instance} in {req.checkpoint_dir}"
    selected: list[Record] = []
    found: set[str] = set()
    for index, record in enumerate(records):
        try:
            key = EpisodeId.model_validate(record["episode_id"]).capture_key
        except (KeyError, TypeError, ValidationError):
            raise CheckpointError(f"record {index} of {where} has no valid episode_id") from None
        if key in wanted:
            selected.append(record)
            found.add(key)
    missing = sorted(wanted - found)
    if missing:
        raise CheckpointError(f"{where} has no records for {missing[:10]} ({len(missing)} missing)")
    return selected
