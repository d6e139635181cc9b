"""What makes a checkpoint directory belong to one run (``run_identity.json``).

Resuming from a directory another run wrote would mix two runs' prompt groups,
weights or Gym topologies without a word. The first start records the run's
identity (training data digest, model, group size, Gym shards and their agents);
every later start compares and refuses, before Ray or any Gym server starts,
naming each difference, unless ``checkpointing.allow_different_run`` is true.

A shard's replica count is recorded but is not identity: a relaunch on fewer or
more replicas resumes as it is (elastic restore, docs/design.md §5.7), and the
restore records the change (``replica_changes``) and then the new count
(``record_replicas``). A removed or renamed shard is named as such: the saved
rollouts of its agents would have nowhere to run.

This module is the file and its comparison; what a run's identity is (from its config) is
``nemo_rl.algorithms.single_controller_utils.run_identity_check``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from nemo_rl.utils.atomic_write import write_json_atomic

logger = logging.getLogger(__name__)
IDENTITY_FILE = "run_identity.json"


class RunIdentityError(ValueError):
    """The checkpoint directory holds another run; the message names what differs."""


class RunIdentity(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = 1
    train_data_sha256: str
    model_name: str
    num_generations_per_prompt: int
    gym_topology: dict[str, dict[str, object]]  # shard -> {replicas, agents}

    def differences(self, other: "RunIdentity") -> list[str]:
        out = []
        if self.train_data_sha256 != other.train_data_sha256:
            out.append(f"other training data (sha256 {other.train_data_sha256[:12]}..., "
                       f"this run's {self.train_data_sha256[:12]}...)")
        if self.model_name != other.model_name:
            out.append(f"another model (policy.model_name {other.model_name!r}, this run's {self.model_name!r})")
        if self.num_generations_per_prompt != other.num_generations_per_prompt:
            out.append(f"another group size (grpo.num_generations_per_prompt {other.num_generations_per_prompt}, "
                       f"this run's {self.num_generations_per_prompt})")
        out += _shard_differences(other.shard_agents(), self.shard_agents())
        return out

    def shard_agents(self) -> dict[str, list[str]]:
        """shard -> its agents: the topology that is identity (replica counts are not)."""
        return {shard: sorted(entry.get("agents") or []) for shard, entry in self.gym_topology.items()}

    def replicas(self) -> dict[str, int]:
        return {shard: int(entry["replicas"]) for shard, entry in self.gym_topology.items() if "replicas" in entry}


def _shard_differences(theirs: dict[str, list[str]], ours: dict[str, list[str]]) -> list[str]:
    """Shards removed, renamed (same agents under a new name) or serving other agents, each named."""
    out = []
    added = {s: a for s, a in ours.items() if s not in theirs}
    for shard, agents in sorted(theirs.items()):
        if shard in ours:
            if ours[shard] != agents:
                out.append(f"another Gym topology: shard {shard!r} serves agents {ours[shard]}, the saved run's "
                           f"served {agents}")
            continue
        renamed = sorted(s for s, a in added.items() if a == agents)
        if renamed:
            out.append(f"Gym shard {shard!r} was renamed to {renamed[0]!r} (same agents {agents}): a shard's name "
                       f"is where its saved rollouts live; name it {shard!r} again (its replicas may change)")
        else:
            out.append(f"Gym shard {shard!r} (agents {agents}) is gone from env.nemo_gym.shards: the task sources "
                       f"of its agents would have nowhere to run; put it back under that name (its replicas may "
                       "change)")
    for shard, agents in sorted(added.items()):
        if not any(a == agents for s, a in theirs.items() if s not in ours):
            out.append(f"another Gym topology: shard {shard!r} (agents {agents}) is new")
    return out


def check_identity(root: Path, identity: Callable[[], RunIdentity], allow_different_run: bool,
                   holds_checkpoints: Callable[[], bool]) -> None:
    """Refuse the checkpoint directory ``root`` if another run wrote it (call before anything starts);
    ``identity()`` is this run's (made only when needed: it reads the training data);
    ``holds_checkpoints()`` is the run store's answer for a directory without an identity."""
    path = root / IDENTITY_FILE
    if not path.exists():
        if holds_checkpoints():
            logger.warning("%s has checkpoints but no %s (an older version wrote them); this run's identity "
                           "is recorded", root, IDENTITY_FILE)
            record_identity(root, identity())
        return
    try:
        theirs = RunIdentity.model_validate_json(path.read_text())
    except (OSError, ValidationError, ValueError) as exc:
        raise RunIdentityError(f"{path}: cannot read the run identity ({exc})") from None
    ours = identity()
    differs = ours.differences(theirs)
    if not differs:
        changed = _changes(theirs.replicas(), ours.replicas())
        if changed:
            logger.info("Gym replicas changed since the last start (%s): resuming on the new shape; saved rollouts "
                        "of replicas that no longer run continue on their shard's other replicas",
                        ", ".join(f"{s}: {c['from']} -> {c['to']}" for s, c in sorted(changed.items())))
        return
    message = (f"{root} holds checkpoints of a different run: {'; '.join(differs)}. Use another "
               "checkpointing.checkpoint_dir, or set checkpointing.allow_different_run=true to resume anyway")
    if not allow_different_run:
        raise RunIdentityError(message)
    logger.warning("%s (checkpointing.allow_different_run=true: resuming anyway; the directory now records this "
                   "run)", message)
    record_identity(root, ours)


def record_identity(root: Path, identity: RunIdentity) -> None:
    """Write a run's identity into its checkpoint directory (a new run, or an allowed takeover)."""
    root.mkdir(parents=True, exist_ok=True)
    write_json_atomic(root / IDENTITY_FILE, identity.model_dump(mode="json"))


def _changes(before: dict[str, int], now: dict[str, int]) -> dict[str, dict[str, int]]:
    return {shard: {"from": before[shard], "to": count} for shard, count in sorted(now.items())
            if shard in before and before[shard] != count}


def replica_changes(checkpoint_dir: Path, replicas: dict[str, int]) -> dict[str, dict[str, int]]:
    """shard -> {from, to} for each shard whose replica count differs from the recorded one (``resharded``
    in ``restore.json``); empty without a readable identity."""
    try:
        recorded = RunIdentity.model_validate_json((Path(checkpoint_dir) / IDENTITY_FILE).read_text())
    except (OSError, ValidationError, ValueError):
        return {}
    return _changes(recorded.replicas(), replicas)


def record_replicas(checkpoint_dir: Path, replicas: dict[str, int]) -> None:
    """Record the replica counts a restore resumed on (the rest of the identity stays as it is)."""
    path = Path(checkpoint_dir) / IDENTITY_FILE
    identity = RunIdentity.model_validate_json(path.read_text())
    topology = {shard: {**entry, "replicas": replicas.get(shard, entry.get("replicas"))}
                for shard, entry in identity.gym_topology.items()}
    write_json_atomic(path, identity.model_copy(update={"gym_topology": topology}).model_dump(mode="json"))
