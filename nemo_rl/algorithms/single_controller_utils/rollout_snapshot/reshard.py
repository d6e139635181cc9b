"""Elastic restore: which running replica installs each saved episode (docs/design.md §5.7, "Elastic restore").

A snapshot keys what Gym saved by the replica that saved it. When the relaunch runs fewer replicas
of a shard, the episodes of each replica that no longer runs (a *vanished* one) continue on the
shard's surviving replicas: every vanished replica in index order, its episodes in capture-key
order, dealt round robin over the survivors in index order, so the same snapshot and shape always
give the same plan. An episode goes whole (its records on every server move together). A server
whose records are not portable (its status says ``records_portable: false``) keeps its episodes
home: those of a vanished replica restart from their prompt instead. A snapshot naming a shard
that no longer runs is refused (its task sources would have nowhere to run).

Pure functions over names, like the snapshot planner (``planner.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gym_patches.checkpoint.identity import EpisodeId

_INSTANCE = re.compile(r"^(?P<shard>.+)/replica-(?P<index>[0-9]+)$")

# target replica -> source replica (itself, or a vanished one) -> server -> capture keys to install
RestoreSources = dict[str, dict[str, dict[str, list[str]]]]


class GymShardRemoved(ValueError):
    """The snapshot holds rollouts of Gym shards this run does not start; the message names them."""

    def __init__(self, shards: dict[str, list[str]], running: list[str]):
        self.shards = shards
        named = "; ".join(f"shard {s!r} (saved on {', '.join(iids)})" for s, iids in sorted(shards.items()))
        super().__init__(
            f"the rollout snapshot holds rollouts of Gym shards this run does not start: {named}; this run's "
            f"shards are {running}. Their task sources would have nowhere to run. Put each shard back in "
            "env.nemo_gym.shards under the same name (any number of replicas), or set "
            "rollout_checkpointing.restore_mode=trainer_checkpoint to restart every saved rollout from its "
            "prompt, or use another checkpointing.checkpoint_dir")


def split_instance(instance_id: str) -> tuple[str, int]:
    """``<shard>/replica-<i>`` -> (shard, i)."""
    match = _INSTANCE.match(instance_id)
    if match is None:
        raise ValueError(f"Gym instance id {instance_id!r} is not <shard>/replica-<i>")
    return match["shard"], int(match["index"])


def replica_counts(instance_ids: list[str]) -> dict[str, int]:
    """shard -> replicas, of a run's instance ids (replicas are numbered from 0)."""
    counts: dict[str, int] = {}
    for iid in instance_ids:
        shard, index = split_instance(iid)
        counts[shard] = max(counts.get(shard, 0), index + 1)
    return counts


@dataclass(frozen=True)
class RestorePlan:
    """What each running replica installs, and what moved or could not."""

    sources: RestoreSources
    moved: dict[str, tuple[str, str]] = field(default_factory=dict)  # saved capture key -> (from, to)
    # saved capture key -> why it restarts from its prompt (a vanished replica's, on a server whose
    # records are not portable)
    not_portable: dict[str, str] = field(default_factory=dict)

    def source_of(self, target: str, capture_key: str) -> str:
        """The replica that saved the episode ``target`` installs under ``capture_key`` (a saved key)."""
        moved = self.moved.get(capture_key)
        return moved[0] if moved is not None and moved[1] == target else target


def vanished(exported: dict[str, dict[str, list[str]]], running: list[str]) -> list[str]:
    """Replicas that saved episodes and do not run now (their shard does), in order."""
    shards = {split_instance(iid)[0] for iid in running}
    return sorted((iid for iid in exported if iid not in running and split_instance(iid)[0] in shards),
                  key=split_instance)


def plan_restore(
    exported: dict[str, dict[str, list[str]]],
    running: list[str],
    unportable_servers: dict[str, set[str]] | None = None,
) -> RestorePlan:
    """Where each saved episode (``exported[replica][server]``) is installed, given the running replicas.

    ``unportable_servers[shard]``: servers of that shard whose records are not portable. Same shape
    (every saving replica runs): each replica installs its own, as before elastic restore."""
    running = sorted(running, key=split_instance)
    shards: dict[str, list[str]] = {}
    for iid in running:
        shards.setdefault(split_instance(iid)[0], []).append(iid)
    removed: dict[str, list[str]] = {}
    for iid in sorted(exported):
        shard = split_instance(iid)[0]
        if shard not in shards:
            removed.setdefault(shard, []).append(iid)
    if removed:
        raise GymShardRemoved(removed, sorted(shards))
    sources: RestoreSources = {iid: {iid: dict(by_server)} for iid, by_server in exported.items() if iid in running}
    moved: dict[str, tuple[str, str]] = {}
    not_portable: dict[str, str] = {}
    dealt: dict[str, int] = {}  # shard -> episodes dealt so far (the round robin continues across replicas)
    for source in vanished(exported, running):
        shard = split_instance(source)[0]
        survivors = shards[shard]
        by_server = exported[source]
        blocked = sorted((unportable_servers or {}).get(shard, set()) & set(by_server))
        keys = sorted({k for ks in by_server.values() for k in ks}, key=_episode_order)
        assigned: dict[str, str] = {}
        for key in keys:
            holders = [s for s in blocked if key in by_server[s]]
            if holders:
                not_portable[key] = (f"saved on {source}, which no longer runs, by Gym server(s) "
                                     f"{', '.join(map(repr, holders))}, whose records are not portable")
                continue
            target = survivors[dealt.get(shard, 0) % len(survivors)]
            dealt[shard] = dealt.get(shard, 0) + 1
            assigned[key] = target
            moved[key] = (source, target)
        for server, server_keys in by_server.items():
            for key in sorted(set(server_keys) & set(assigned), key=_episode_order):
                scope = sources.setdefault(assigned[key], {}).setdefault(source, {})
                scope.setdefault(server, []).append(key)
        for target in survivors:  # every server of a source the target reads, listed (maybe empty)
            if source in sources.get(target, {}):
                for server in by_server:
                    sources[target][source].setdefault(server, [])
    return RestorePlan(sources, moved, not_portable)


def _episode_order(capture_key: str) -> tuple[str, int]:
    episode = EpisodeId.from_capture_key(capture_key)
    return episode.rollout_id, episode.attempt
