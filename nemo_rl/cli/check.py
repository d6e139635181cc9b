"""``run_grpo --check``: the config and the Gym setup checked, nothing trained (docs/design.md §5.2).

Prints the merged config, starts Ray and every Gym shard replica exactly as a
run does (``init_ray``, ``_spinup_gym`` with its restart-only setup check, over
the training rows, so per-agent and per-task-source levels count), prints every
server of every replica with its checkpoint mode and the rollouts it serves,
then stops everything it started. Exit 0: a run would pass setup; 1: it would
not (the error printed, as the run would print it). No policy is built, no
checkpoint or log directory is written: Gym's logs go to a temporary directory,
kept (and named) only when the check fails.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from nemo_rl.algorithms.single_controller_utils.config import MasterConfig
from nemo_rl.utils.run_hooks import RunHooks


class _KeepRefusal(RunHooks):
    """The setup check's refusal is kept, so the server table is still printed before exiting 1."""

    def __init__(self) -> None:
        self.refusal: Exception | None = None

    def on_restart_only_servers(self, error: Exception) -> None:
        self.refusal = error


@dataclass(frozen=True)
class ServerRow:
    replica: str
    server: str
    kind: str
    checkpoint: str  # saves / stateless / restart-only (discovered live at turn level) / replayed / saves, replayable
    serves: str  # the agents whose rollouts pass through it, with their levels
    turn_level: bool  # a turn-level rollout passes through it
    snapshot: str  # what a snapshot does with its rollouts


def server_rows(config: MasterConfig, shard_set, rows: list[dict]) -> list[ServerRow]:
    """Every server of every replica, from the shard set ``_spinup_gym`` started (restart-only servers
    as its replicas reported them) and the same level rules the setup check uses."""
    from gym_patches.config import parse_gym_config
    from nemo_rl.algorithms.single_controller_utils.gym_server_levels import agent_levels, turn_level_users
    from nemo_rl.algorithms.single_controller_utils.setup import shard_gym_config
    from nemo_rl.environments.nemo_gym import build_gym_actor_config

    recovery = config.rollout_recovery
    turn = recovery.turn_checkpointing_enabled
    env = config.env.nemo_gym
    out = []
    for shard in env.shards:
        parsed = parse_gym_config(build_gym_actor_config(
            shard_gym_config(env, shard), policy_base_url="http://127.0.0.1:1/v1",
            control_auth_token="config-check-only", checkpointing=turn))
        uses = shard_set.agent_servers.get(shard.name, {})  # agent -> the servers it calls (itself included)
        agent_resources = {name: ((inst.config.get("resources_server") or {}).get("name") or None)
                           for name, inst in parsed.instances.items() if inst.server_type == "responses_api_agents"}
        levels = agent_levels(recovery, rows, agent_resources)
        replay = shard_set.replay_models.get(shard.name, {})
        users = turn_level_users(recovery, rows, agent_resources, replayed=replay)
        for i in range(shard.replicas):
            iid = f"{shard.name}/replica-{i}"
            restart_only = set(shard_set.restart_only_servers.get(iid, []))
            out += [_server_row(config, iid, name, inst, restart_only, uses, levels, users, replay)
                    for name, inst in parsed.instances.items()]
    return out


def _server_row(config: MasterConfig, iid: str, name: str, inst, restart_only: set[str],
                uses: dict[str, list[str]], levels: dict, users: dict[str, list[str]],
                replay: dict[str, str]) -> ServerRow:
    """One server's row on replica ``iid`` (split out of ``server_rows``)."""
    from gym_patches.config import SERVER_KIND
    from gym_patches.server_catalog import declared_checkpoint

    label = declared_checkpoint(inst).mode
    if name in restart_only and label != "replayed":
        label = "restart-only"  # as the replica reported it
    agents = sorted(a for a, servers in uses.items() if name in servers)
    serves = ", ".join(f"{a} ({'/'.join(sorted(lv.value for lv in levels.get(a, ())))})" for a in agents)
    # a model server is never restart-only here; it carries the turn-level rollouts of its agents
    turn_users = users if inst.server_type != "responses_api_models" else \
        {name: [a for a in agents if a in users]} if any(a in users for a in agents) else {}
    replayed = [a for a in agents if a in replay]
    return ServerRow(iid, name, SERVER_KIND[inst.server_type], label, serves or "-",
                     name in turn_users or bool(replayed),
                     _snapshot_text(config, name, label, turn_users, restart_only, uses, replayed))


def _snapshot_text(config: MasterConfig, name: str, label: str, users: dict[str, list[str]],
                   restart_only: set[str], uses: dict[str, list[str]], replayed: list[str] = ()) -> str:
    recovery = config.rollout_recovery
    if not recovery.turn_checkpointing_enabled:
        return f"not asked (target_level={recovery.target_level.value}: the ledger and sealed samples only)"
    if replayed and name not in users:
        return (f"replayed: the rollouts of {', '.join(replayed)} come back by replay (their model server records "
                "their calls)" + ("; best_effort, never blocks" if name in restart_only else ""))
    if name not in users:
        return "best_effort, never blocks (no turn-level rollout)" if label == "restart-only" else \
            "not asked (serves coarser levels only)"
    blocking = sorted(s for s in uses.get(name, [name]) if s in restart_only and s in users)
    if not blocking:
        return "saved at turn level"
    who = "it is restart-only" if blocking == [name] else f"uses restart-only {', '.join(blocking)}"
    if recovery.allow_restart_only_gym_servers:
        return f"unsaved, restart from the prompt ({who})"
    return f"REFUSED by the setup check ({who})"


def render(rows: list[ServerRow]) -> str:
    head = ("replica", "server", "kind", "checkpoint", "serves (agent (level))", "turn-level", "in a snapshot")
    body = [(r.replica, r.server, r.kind, r.checkpoint, r.serves, "yes" if r.turn_level else "no", r.snapshot)
            for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, body)])


def check(config: MasterConfig) -> int:
    """Print the merged config, start and check the Gym setup, print every server, stop; 0 or 1."""
    import ray

    from gym_patches.config import GymConfigError
    from nemo_rl.algorithms.single_controller_utils.components import reserve_policy_url
    from nemo_rl.algorithms.single_controller_utils.setup import _spinup_gym, check_gym_configs, init_ray
    from nemo_rl.data.dataloader import load_jsonl
    from nemo_rl.algorithms.single_controller_utils.run_identity_check import check_run_identity

    print("# merged config", flush=True)
    print(config.to_yaml(), flush=True)
    try:
        check_gym_configs(config)
    except GymConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logs = Path(tempfile.mkdtemp(prefix="run_grpo-check-"))
    shard_set, ray_started, failed = None, False, True
    hooks = _KeepRefusal()
    try:
        check_run_identity(config)  # another run's checkpoint_dir: refused as the run would refuse it
        rows = load_jsonl(config.data.train_data_path)
        init_ray(config)
        ray_started = True
        policy_url, hold = reserve_policy_url(config)  # nothing serves it: no rollout runs, only the setup
        hold.release()
        shard_set = _spinup_gym(config, policy_base_url=policy_url, log_dir=logs, rows=rows, hooks=hooks)
        table = render(server_rows(config, shard_set, rows))
        failed = hooks.refusal is not None
    except (ValueError, RuntimeError) as exc:  # RayConnectError, ShardSetupError, GymConfigError, identity
        print(f"error: {exc}\nGym logs: {logs}", file=sys.stderr)
        return 1
    finally:
        if shard_set is not None:
            shard_set.shutdown()
        if ray_started:
            ray.shutdown()
        if not failed:
            shutil.rmtree(logs, ignore_errors=True)
    level = config.rollout_recovery.target_level.value
    print(f"# Gym servers ({len(shard_set.instances)} replica(s), rollout_recovery.target_level={level})")
    print(table, flush=True)
    if hooks.refusal is not None:
        print(f"error: {hooks.refusal}\nGym logs: {logs}", file=sys.stderr)
        print("setup check: FAILED (a run with this config stops here, before the first rollout)", flush=True)
        return 1
    print("setup check: passed (a run with this config gets past setup)", flush=True)
    return 0
