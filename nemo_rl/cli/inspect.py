"""``python -m nemo_rl.cli.inspect <checkpoint_dir>``: what a restart would restore, starting nothing.

Lists every trainer step (``bootstrap/``, ``step_N/``) and rollout snapshot with
its validity (the commit marker: manifest and file sizes), size and age, then
runs the relaunch's own restore (docs/design.md §5.5): ``find_restore_point``
picks (and hashes) the same trainer step and snapshot, and ``RunRestorer``
applies the same ledger restart rules and elastic-restore plan, so the counts
it prints are the ones the relaunch writes to ``restore.json`` (``--json``:
under the same keys). Two stand-ins replace what a relaunch starts:

- Gym: a saved episode is assumed to be restored by Gym as the next attempt of
  what the snapshot's ``gym_checkpoint.json`` says was saved at turn level, on
  the replica the plan sends it to (every server's records assumed portable);
- the trainer: its bookkeeping is read from the step's state file, no weights.

Nothing is written. Without ``--config`` the relaunch's settings are taken from
the directory (turn level if its snapshots hold a Gym index; the replica counts
of ``run_identity.json``); with it, from the run's config, as a relaunch with
that config would.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from gym_patches.checkpoint.identity import EpisodeId, next_attempt
from gym_patches.checkpoint.storage import StorageWriter
from nemo_rl.algorithms.recording_trainer import STATE_FILE as RECORDING_STATE_FILE
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.reshard import replica_counts
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.restore import RunRestorer, find_restore_point
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.store import (
    GYM_CHECKPOINT_FILE,
    GymCheckpointIndex,
    Listed,
    RunStore,
    list_checkpoint_dir,
)
from nemo_rl.utils.run_hooks import RunHooks
from nemo_rl.utils.snapshot_store import SnapshotStoreError
from nemo_rl.utils.recovery_record import RecoveryRecord, read_recoveries

# The counts of restore.json, in the order they are printed.
COUNT_KEYS = ("retrained_groups", "restored_turn", "restored_replay", "restored_prefix", "prefix_tokens", "restarted_from_prompt",
              "kept_siblings", "redone_groups", "dropped_trained_groups")


# ----------------------------------------------------------------------------- the listing
_TEMPORARY = {"trainer_step": "unpublished (a crash left it; the next start removes it)",
              "rollout_snapshot": "unpublished (the snapshot was not finished)"}


def _entry(listed: Listed, now: float, within: str) -> dict[str, Any]:
    """One directory as the report shows it: valid (its commit marker holds) or why not, its size, its age."""
    out: dict[str, Any] = {"path": str(listed.path), "kind": listed.kind, "size_bytes": listed.size_bytes}
    if listed.kind == "temporary":
        out.update(valid=False, reason=_TEMPORARY[within], age_s=round(now - listed.path.stat().st_mtime, 1))
    elif listed.manifest is not None:
        out.update(valid=True, reason=None, age_s=round(now - listed.manifest.created_at, 1),
                   files=sorted(listed.manifest.files))
    else:
        out.update(valid=False, reason=listed.reason, age_s=round(now - listed.path.stat().st_mtime, 1), files=[])
    return out


def list_directory(checkpoint_dir: Path) -> list[dict[str, Any]]:
    """Every anchor (newest first) with its snapshots (newest first), and leftover temporary dirs (the run
    store's listing, ``list_checkpoint_dir``)."""
    now = time.time()
    return [{**_entry(anchor, now, "trainer_step"), "step": anchor.step,
             "snapshots": [_entry(snap, now, "rollout_snapshot") for snap in anchor.snapshots]}
            for anchor in list_checkpoint_dir(checkpoint_dir)]


def infer_turn_level(anchors: list[dict[str, Any]]) -> bool:
    """Whether the run saved turns: any valid snapshot holds a Gym index."""
    return any(GYM_CHECKPOINT_FILE in s.get("files", []) for a in anchors for s in a["snapshots"] if s["valid"])


# ----------------------------------------------------------------------------- the stand-ins
class _SavedEpisodes:
    """Gym's side of a restore as the snapshot recorded it: each episode saved at turn level is installed
    as its next attempt on the replica the plan names. Answers the calls ``RunRestorer`` makes."""

    def __init__(self, instance_ids: list[str]):
        self.instance_ids = sorted(instance_ids)

    async def unportable_servers(self, shards: list[str], among: list[str] | None = None) -> dict[str, set[str]]:
        return {}  # assumed portable: only the live servers can say otherwise

    async def restore(self, restore_id: str, root: str, sources: dict[str, dict[str, dict[str, list[str]]]],
                      checkpoint_id: str, replay: frozenset[str] = frozenset()) -> dict[str, list[str]]:
        index = GymCheckpointIndex.read(Path(root))  # saved at their turn, or for replay (docs/design.md §4.8)
        saved = {iid: set(keys) | index.replayed_keys(iid) for iid, keys in index.turn_level.items()}
        return {target: sorted({next_attempt(EpisodeId.from_capture_key(key)).capture_key
                                for source, by_server in from_sources.items()
                                for keys in by_server.values() for key in keys if key in saved.get(source, ())})
                for target, from_sources in sources.items()}


async def _bookkeeping(anchor: Path) -> dict[str, Any]:
    """What the trainer's ``load`` returns (the controller's bookkeeping), read without loading weights."""
    for name, key in (("trainer_state.json", "dataloader_state"), (RECORDING_STATE_FILE, "extra_state")):
        path = anchor / name
        if path.is_file():
            return json.loads(path.read_text()).get(key) or {}
    raise SnapshotStoreError(f"{anchor}: no trainer_state.json or {RECORDING_STATE_FILE} (not a trainer checkpoint)")


class _RefusingWriter(StorageWriter):
    """The inspector's writer: it refuses every write, so the restore it runs provably changes nothing."""

    def _refuse(self, path: Path, *_: Any, **__: Any) -> Any:
        raise PermissionError(f"the inspector writes nothing, but its restore tried {path}")

    write = open_write = put = commit = make_dirs = remove = _refuse  # type: ignore[assignment]


class _ReadOnlyRestorer(RunRestorer):
    """The relaunch's restorer, except that the replica counts it resumes on are not recorded."""

    def _record_replicas(self, record: dict[str, Any]) -> None:
        from nemo_rl.utils.run_identity import replica_changes

        if self.coordinator is not None:
            record["resharded"] = replica_changes(self.checkpoint_dir, replica_counts(self.coordinator.instance_ids))


def _saved_config(anchors: list[dict[str, Any]]):
    """The config the newest valid trainer step holds (``step_N/config.yaml``), if any: (config, path)."""
    import yaml

    from nemo_rl.algorithms.single_controller_utils.config import ConfigError, build_config

    for anchor in anchors:
        path = Path(anchor["path"]) / "config.yaml"
        if anchor["valid"] and "config.yaml" in anchor.get("files", []):
            try:
                return build_config(yaml.safe_load(path.read_text()), str(path)), path
            except (ConfigError, yaml.YAMLError, OSError):
                continue  # an older schema's config: the directory's own evidence decides
    return None, None


def _recorded_instances(checkpoint_dir: Path, anchors: list[dict[str, Any]]) -> list[str]:
    """The replicas the run last ran (``run_identity.json``), else those its snapshots name."""
    from nemo_rl.utils.run_identity import IDENTITY_FILE, RunIdentity

    try:
        identity = RunIdentity.model_validate_json((checkpoint_dir / IDENTITY_FILE).read_text())
        return [f"{shard}/replica-{i}" for shard, n in identity.replicas().items() for i in range(n)]
    except (OSError, ValueError):
        pass
    found: set[str] = set()
    for anchor in anchors:
        for snap in anchor["snapshots"]:
            if snap["valid"] and GYM_CHECKPOINT_FILE in snap["files"]:
                found |= set(GymCheckpointIndex.read(Path(snap["path"])).instances)
    return sorted(found)


def what_a_restart_restores(checkpoint_dir: Path, *, turn_level: bool, read_snapshots: bool,
                            max_attempts: int, instance_ids: list[str]) -> dict[str, Any] | None:
    """The ``restore.json`` record the relaunch would write (None: nothing to restore, a new run)."""
    lookup = find_restore_point(checkpoint_dir, turn_level=turn_level, read_snapshots=read_snapshots)
    restorer = _ReadOnlyRestorer(
        checkpoint_dir, read_snapshots=read_snapshots,
        coordinator=_SavedEpisodes(instance_ids) if turn_level else None,
        max_attempts_per_sibling=max_attempts, load_trainer=_bookkeeping, hooks=RunHooks(),
        store=RunStore(checkpoint_dir, _RefusingWriter(), keep_latest_k=1))
    restored = asyncio.run(restorer.restore(lookup))
    return None if restored is None else {**restored.record, "message": restored.message}


# ----------------------------------------------------------------------------- output
def _human_size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def render(report: dict[str, Any]) -> str:
    record = report["restore"]
    chosen = {record.get("snapshot"), report.get("restore_anchor")} if record else set()
    lines = [f"checkpoint dir: {report['checkpoint_dir']}", f"({report['settings']})", ""]
    for anchor in report["anchors"]:
        mark = "  <- a restart uses this step" if anchor["path"] in chosen else ""
        state = "valid" if anchor["valid"] else f"INVALID: {anchor['reason']}"
        lines.append(f"{Path(anchor['path']).name:<20} {_human_size(anchor['size_bytes']):>9}  "
                     f"{_age(anchor['age_s']):>11}  {state}{mark}")
        for snap in anchor["snapshots"]:
            mark = "  <- a restart uses this snapshot" if snap["path"] in chosen else ""
            state = "valid" if snap["valid"] else f"INVALID: {snap['reason']}"
            lines.append(f"  {Path(snap['path']).name:<18} {_human_size(snap['size_bytes']):>9}  "
                         f"{_age(snap['age_s']):>11}  {state}{mark}")
    lines.append("")
    for row in map(RecoveryRecord.model_validate, report.get("recoveries", [])):
        if row.part == "generation":
            lines.append(f"in-run recovery: generation worker {row.cause}: {row.action}, {row.calls_resent} model "
                         f"calls sent again ({row.calls_continued_from_cut} from a cut), "
                         f"{len(row.restarted_from_prompt)} from the prompt")
            continue
        lines.append(f"in-run recovery: {row.what} {row.cause}: {row.action}, "
                     f"{len(row.continued_turn) + len(row.continued_prefix)} continued, "
                     f"{len(row.restarted_from_prompt)} from the prompt")
    if report.get("complete"):
        lines.append(report["complete"])
        return "\n".join(lines)
    if record is None:
        lines.append("A restart finds no intact trainer step: it starts a new run.")
        return "\n".join(lines)
    for item in record.get("skipped_trainer_steps", []) + record.get("skipped_snapshots", []):
        lines.append(f"skipped: {item['reason']}")
    lines.append(record["message"])
    lines.append("counts (restore.json keys): " + ", ".join(f"{k}={record[k]}" for k in COUNT_KEYS if k in record))
    if record.get("resharded"):
        lines.append(f"resharded: {record['resharded']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nemo_rl.cli.inspect", allow_abbrev=False,
        description="What a restart of the run in CHECKPOINT_DIR would restore, starting nothing: every trainer "
                    "step and rollout snapshot (valid, size, age), the ones a restart uses, and the counts it "
                    "writes to restore.json.")
    parser.add_argument("checkpoint_dir", nargs="?", help="checkpointing.checkpoint_dir of the run "
                                                          "(default with --config: the config's)")
    parser.add_argument("--json", action="store_true", help="one JSON object (the counts under restore.json's keys)")
    parser.add_argument("--config", metavar="FILE.yaml",
                        help="the run's config: its recovery level, restore_mode and Gym replicas decide")
    args, overrides = parser.parse_known_args(argv)
    bad = [a for a in overrides if a.startswith("-") or "=" not in a]
    if bad or (overrides and not args.config):
        parser.error(f"unexpected argument {(bad or overrides)[0]!r} (key=value overrides need --config)")
    try:
        report = inspect(args.checkpoint_dir, args.config, overrides)
    except (ValueError, OSError) as exc:  # ConfigError, SnapshotStoreError, GymShardRemoved, a missing dir
        from nemo_rl.algorithms.single_controller_utils.config import ConfigError

        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    print(json.dumps(report, indent=1) if args.json else render(report))
    return 0


def inspect(checkpoint_dir: str | None, config_path: str | None = None, overrides: list[str] = ()) -> dict[str, Any]:
    """The listing and the restore record, as ``--json`` prints them."""
    config = None
    if config_path is not None:
        from nemo_rl.algorithms.single_controller_utils.config import load_config

        config = load_config(config_path, list(overrides))
    if checkpoint_dir is None:
        if config is None:
            raise ValueError("give a checkpoint directory, or --config to take the config's "
                             "checkpointing.checkpoint_dir")
        checkpoint_dir = config.checkpointing.checkpoint_dir
    root = Path(checkpoint_dir)
    if not root.is_dir():
        raise ValueError(f"{root}: not a directory" + ("" if root.exists() else " (no such directory)"))
    anchors = list_directory(root)
    settings = f"settings from --config {config_path}"
    if config is None:
        config, saved = _saved_config(anchors)
        settings = f"settings from {saved}, the config the newest step was trained with" if saved else ""
    if config is not None:
        turn_level = config.rollout_recovery.turn_checkpointing_enabled
        read_snapshots = config.rollout_checkpointing.restore_mode != "trainer_checkpoint"
        max_attempts = config.async_rl.rollout_failure.max_infra_attempts_per_prompt
        instance_ids = config.env.nemo_gym.instance_ids()
    else:
        from nemo_rl.algorithms.single_controller_utils.config import AsyncRLConfig

        turn_level = infer_turn_level(anchors)
        read_snapshots = True
        max_attempts = AsyncRLConfig().rollout_failure.max_infra_attempts_per_prompt
        instance_ids = _recorded_instances(root, anchors)
        settings = (f"{'turn' if turn_level else 'ledger-only'} snapshots, taken from the directory; "
                    "--config FILE for the run's own settings")
    record = what_a_restart_restores(root, turn_level=turn_level, read_snapshots=read_snapshots,
                                     max_attempts=max_attempts, instance_ids=instance_ids)
    complete = None
    if record is not None and config is not None and record["trainer_step"] >= config.grpo.max_num_steps:
        complete = (f"The run is complete: trainer step {record['trainer_step']} of grpo.max_num_steps="
                    f"{config.grpo.max_num_steps}; a restart with these settings restores nothing and exits "
                    "(raise grpo.max_num_steps to train further).")
    anchor = None if record is None else next(
        (a["path"] for a in anchors if a["step"] == record["trainer_step"] and a["kind"] != "temporary"), None)
    for entry in anchors:  # the file lists were for the settings; the report keeps the directories
        entry.pop("files", None)
        for snap in entry["snapshots"]:
            snap.pop("files", None)
    return {"checkpoint_dir": str(root.absolute()), "settings": settings, "turn_level": turn_level,
            "anchors": anchors, "restore_anchor": anchor, "restore": record, "complete": complete,
            "recoveries": _last_recoveries(config)}


def _last_recoveries(config: Any, count: int = 5) -> list[dict[str, Any]]:
    """The run's newest in-run recoveries (``recoveries.jsonl`` in its log dir, read through its one schema,
    ``RecoveryRecord``: docs/design.md §5.12)."""
    if config is None:
        return []
    return [row.row() for row in read_recoveries(Path(config.logger.log_dir) / "recoveries.jsonl")[-count:]]


if __name__ == "__main__":
    sys.exit(main())
