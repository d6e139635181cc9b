"""Which Gym servers carry turn-level rollouts, given per-agent and per-task-source levels.

A restart-only server only matters to turn recovery if some rollout that must
continue at turn level passes through it: an agent whose rows resolve to
``turn``, or the resources server such an agent calls. A restart-only server
that serves only ``sibling``/``prompt_group`` agents, or only agents whose
rollouts come back by replay, is not named by the setup check, and it prepares
``best_effort`` so it never stalls a snapshot.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from nemo_rl.algorithms.single_controller_utils.config import RolloutRecoveryConfig
from nemo_rl.experience.rollout_recovery import RecoveryTargetLevel
from gym_patches.checkpoint.wire import RestartOnlyPolicy


def agent_levels(
    recovery: RolloutRecoveryConfig, rows: Iterable[Mapping[str, Any]], agents: Iterable[str]
) -> dict[str, set[RecoveryTargetLevel]]:
    """The levels each agent's rows resolve to; an agent with no rows gets its own (task source unknown)."""
    levels: dict[str, set[RecoveryTargetLevel]] = {name: set() for name in agents}
    for row in rows:
        agent = (row.get("agent_ref") or {}).get("name")
        if agent in levels:
            levels[agent].add(recovery.resolve_for(row.get("task_source"), agent))
    for name, found in levels.items():
        if not found:
            found.add(recovery.resolve_for(None, name))
    return levels


def turn_level_users(
    recovery: RolloutRecoveryConfig,
    rows: Iterable[Mapping[str, Any]],
    agent_resources: Mapping[str, str | None],
    replayed: Iterable[str] = (),
) -> dict[str, list[str]]:
    """Server name -> the agents whose turn-level rollouts pass through it and need it to save them.

    ``agent_resources`` maps each agent of one Gym deployment to the resources
    server it calls (None: it calls none). An agent is its own user. Agents in
    ``replayed`` (``gym_patches.server_catalog.replay_agents``: their rollouts come
    back by replay, docs/design.md §4.8) need no server to save anything: they use none.
    """
    users: dict[str, set[str]] = {}
    skip = set(replayed)
    for agent, levels in agent_levels(recovery, rows, agent_resources).items():
        if agent in skip or not any(level.requires_gym_checkpoint for level in levels):
            continue
        users.setdefault(agent, set()).add(agent)
        resources = agent_resources[agent]
        if resources:
            users.setdefault(resources, set()).add(agent)
    return {server: sorted(agents) for server, agents in users.items()}


def prepare_policy_overrides(
    restart_only: Iterable[str], turn_users: Mapping[str, list[str]]
) -> dict[str, RestartOnlyPolicy]:
    """``best_effort`` for restart-only servers that no turn-level rollout needs to save (they must not block:
    they serve coarser levels, or only rollouts that come back by replay)."""
    return {name: "best_effort" for name in restart_only if name not in turn_users}


def coarser_level_override(
    recovery: RolloutRecoveryConfig, agents: Iterable[str], level: RecoveryTargetLevel = RecoveryTargetLevel.SIBLING
) -> str:
    """The exact command-line override that moves ``agents`` (and keeps existing overrides) to ``level``."""
    merged = {name: lvl.value for name, lvl in recovery.agent_target_level_overrides.items()}
    for name in agents:
        merged[name] = level.value
    body = ", ".join(f"{name}: {value}" for name, value in merged.items())
    return f"'rollout_recovery.agent_target_level_overrides={{{body}}}'"
