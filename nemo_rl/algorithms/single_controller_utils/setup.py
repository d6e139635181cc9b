"""Setup of the single controller: Ray, the Gym shard set, and the restart-only check.

``_spinup_gym`` runs before any rollout and before policy weights are built, so
a Gym setup that cannot give what ``rollout_recovery`` asks for fails in seconds
with every offending server named (docs/design.md §2, §5.2).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import secrets
import socket
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import ray
import yaml

from gym_patches.config import GymConfigError, parse_gym_config
from gym_patches.server_catalog import replay_agents, with_call_records
from nemo_rl.algorithms.single_controller_utils.config import (
    SCRIPTED_TEST_BACKEND,
    MasterConfig,
    NemoGymEnvConfig,
    ShardConfig,
)
from nemo_rl.algorithms.single_controller_utils.gym_server_levels import (
    coarser_level_override,
    prepare_policy_overrides,
    turn_level_users,
)
from nemo_rl.environments.gym_checkpoint_adapter import GymCheckpointInstance
from nemo_rl.environments.nemo_gym import NemoGymShardSet, ReplicaSpec, build_gym_actor_config, start_replica
from nemo_rl.utils.run_hooks import RunHooks
from nemo_rl.utils.atomic_write import write_json_atomic

logger = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parents[3]


class ShardSetupError(RuntimeError):
    """A Gym shard replica failed to start; names the shard and replica."""


class RayConnectError(RuntimeError):
    """``cluster.ray_address`` could not be joined within ``RAY_CONNECT_TIMEOUT_S``; names the key and address."""


RAY_CONNECT_TIMEOUT_S = 15.0  # joining a cluster: the whole bound, the port probe and ray.init together


def init_ray(config: MasterConfig, connect_timeout_s: float = RAY_CONNECT_TIMEOUT_S) -> None:
    """Start (or join) Ray sized for this machine; torch threads stay at 1 in actors.

    Joining ``cluster.ray_address`` is bounded: the GCS port is probed first (nothing listening
    or an unknown host fails at once), then ``ray.init`` (which otherwise retries for ever) gets
    what is left of ``connect_timeout_s``; either failure is a ``RayConnectError`` naming the key.
    """
    if ray.is_initialized():
        return
    # A worker Ray ends (a killed generation worker, a lost replica's actor) takes its process group with it:
    # a killed vLLM engine's children would otherwise keep its device memory through restarts. The raylet
    # reads this when it starts, so it is set before (docs/design.md §5.12).
    os.environ.setdefault("RAY_process_group_cleanup_enabled", "1")
    kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=True, logging_level=logging.WARNING)
    address = config.cluster.ray_address
    if not address:
        ray.init(num_cpus=config.cluster.num_cpus or 2, num_gpus=config.cluster.gpus_per_node, **kwargs)
        return
    print(f"Joining the Ray cluster at {address} (cluster.ray_address), for up to {connect_timeout_s:g}s", flush=True)
    deadline = time.monotonic() + connect_timeout_s
    _probe_address(address, deadline, connect_timeout_s)
    _init_within(address, kwargs, deadline, connect_timeout_s)


class _DropRecords(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def _ray_connect_error(address: str, why: str) -> RayConnectError:
    return RayConnectError(f"cluster.ray_address={address}: cannot join the Ray cluster: {why} (start it with "
                           "'ray start --head --port=<port>', fix the address, or remove cluster.ray_address "
                           "to start a local Ray)")


def _probe_address(address: str, deadline: float, bound_s: float) -> None:
    """Connect to the address's port once it answers, until ``deadline``; ``auto``/``local`` are not probed."""
    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto", "local", or a form ray.init itself resolves
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=max(0.1, min(2.0, left))):
                return
        except socket.gaierror as exc:
            raise _ray_connect_error(address, f"unknown host {host!r} ({exc.strerror or exc})") from None
        except ConnectionRefusedError:
            raise _ray_connect_error(address, f"nothing listens on {host}:{port} (connection refused)") from None
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise _ray_connect_error(address, f"no answer from {host}:{port} within the "
                                                  f"{bound_s:g}s bound ({exc.strerror or exc})") from None
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def _init_within(address: str, kwargs: dict[str, Any], deadline: float, bound_s: float) -> None:
    """``ray.init(address=...)`` in a daemon thread, given until ``deadline`` (it retries for ever on a
    port that answers but is no Ray GCS); a thread left behind dies with the process."""
    outcome: dict[str, BaseException | None] = {}

    def join() -> None:
        try:
            ray.init(address=address, **kwargs)
            outcome["error"] = None
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            outcome["error"] = exc

    # Off the main thread Ray installs no SIGTERM handler of its own (a local ray.init replaces the
    # process's with sys.exit) and warns so; the process keeps its own handler, so the warning is dropped.
    quiet = _DropRecords("SIGTERM handler is not set")
    ray_worker_log = logging.getLogger("ray._private.worker")
    ray_worker_log.addFilter(quiet)
    thread = threading.Thread(target=join, name="ray-init", daemon=True)
    try:
        thread.start()
        thread.join(max(0.1, deadline - time.monotonic()))
    finally:
        ray_worker_log.removeFilter(quiet)
    if "error" not in outcome:
        raise _ray_connect_error(address, f"no Ray GCS answered there within {bound_s:g}s")
    if outcome["error"] is not None:
        raise _ray_connect_error(address, f"{type(outcome['error']).__name__}: {outcome['error']}") from None


def _resolve_path(path: str) -> Path:
    p = Path(path)
    if p.is_absolute() or p.exists():
        return p
    candidate = REPO_ROOT / p
    return candidate if candidate.exists() else p


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def shard_gym_config(env: NemoGymEnvConfig, shard: ShardConfig) -> dict[str, Any]:
    """Common config_paths, common inline config, then the shard's own, merged in that order."""
    merged: dict[str, Any] = {}
    for path in [*env.config_paths, *shard.config_paths]:
        resolved = _resolve_path(path)
        try:
            data = yaml.safe_load(resolved.read_text()) or {}
        except OSError as exc:
            raise GymConfigError(f"env.nemo_gym config file {path!r} cannot be read: {exc.strerror or exc}") from None
        if not isinstance(data, dict):
            raise GymConfigError(f"env.nemo_gym config file {path!r} must hold a mapping")
        merged = _deep_merge(merged, data)
    merged = _deep_merge(merged, env.config)
    return _deep_merge(merged, shard.config)


def check_gym_configs(config: MasterConfig) -> None:
    """Validate every shard's Gym config (keys and server configs) before Ray or any process starts."""
    env = config.env.nemo_gym
    for shard in env.shards:
        try:
            build_gym_actor_config(
                shard_gym_config(env, shard),
                policy_base_url="http://127.0.0.1:1/v1",  # placeholder: only the shape is checked here
                control_auth_token="config-check-only",
                checkpointing=config.rollout_recovery.turn_checkpointing_enabled,
            )
        except GymConfigError as exc:
            where = "Gym config (env.nemo_gym" + (f", shard {shard.name!r})" if len(env.shards) > 1 else ")")
            raise GymConfigError(f"{where}: {exc}") from None


def shard_agents(config: MasterConfig) -> list[tuple[ShardConfig, list[str]]]:
    """Each shard with the names of its Gym agents, from the config alone (nothing starts)."""
    env = config.env.nemo_gym
    out = []
    for shard in env.shards:
        parsed = parse_gym_config(build_gym_actor_config(
            shard_gym_config(env, shard), policy_base_url="http://127.0.0.1:1/v1",
            control_auth_token="config-check-only", checkpointing=False,
        ))
        out.append((shard, sorted(n for n, i in parsed.instances.items() if i.server_type == "responses_api_agents")))
    return out


def restart_only_check(
    config: MasterConfig,
    restart_only: dict[str, list[str]],
    server_types: dict[str, str],
    turn_users: dict[str, dict[str, list[str]]] | None = None,
) -> None:
    """Raise or warn per ``rollout_recovery.allow_restart_only_gym_servers`` (docs/design.md §2, §5.2).

    ``turn_users[instance][server]`` lists the agents whose turn-level rollouts
    pass through ``server`` there; a restart-only server missing from it serves
    only coarser levels and is not named. ``None``: every server counts.
    """
    recovery = config.rollout_recovery
    if not recovery.turn_checkpointing_enabled:
        return
    # server name -> instances where it is restart-only and carries turn-level rollouts
    where: dict[str, list[str]] = {}
    agents_to_move: set[str] = set()
    for instance_id, names in sorted(restart_only.items()):
        users = None if turn_users is None else turn_users.get(instance_id, {})
        for name in names:
            if users is not None and name not in users:
                continue
            where.setdefault(name, []).append(instance_id)
            agents_to_move.update(users[name] if users is not None else ())
    described = []
    agents_first = sorted(where, key=lambda n: (server_types.get(n) != "responses_api_agents", n))
    for name in agents_first:
        kind = "agent" if server_types.get(name) == "responses_api_agents" else "resources server"
        described.append(f"{kind} {name!r} (on {', '.join(where[name])})")
    level = recovery.target_level.value
    if not recovery.allow_restart_only_gym_servers:
        if described:
            third = (
                f", or (4) give the agents whose rollouts use them a coarser level, e.g. "
                f"{coarser_level_override(recovery, sorted(agents_to_move))} (their rollouts restart from the "
                "prompt after a crash, finished siblings kept; restart-only servers they use then never block)"
                if agents_to_move else ""
            )
            raise ValueError(
                f"rollout_recovery.target_level={level} needs every Gym agent and resources server that serves a "
                f"turn-level rollout to save its rollouts, but these are restart-only: {'; '.join(described)}. "
                "Every turn-level snapshot would stall waiting for them. Fix one of: (1) add checkpoint support to "
                "them (agents: checkpoint_sessions_supported = True with session export/restore; resources servers: "
                "checkpoint_mode 'exported' or 'stateless'), (2) declare them replayable (replayable: true in their "
                "Gym config, and in that of the servers their rollouts also use) if their tools are deterministic "
                "and session-local: their rollouts then come back by replay (docs/design.md §4.8), (3) set "
                "rollout_recovery.allow_restart_only_gym_servers=true to snapshot best-effort (their rollouts "
                f"restart from the prompt after a crash; the others keep {level}-level recovery){third}."
            )
        return
    if described:
        warnings.warn(
            f"rollout_recovery.allow_restart_only_gym_servers=true: best-effort {level}-level snapshots "
            f"(rollout_recovery.target_level={level}). These Gym servers "
            f"are restart-only and their rollouts restart from the prompt after a crash: {'; '.join(described)}",
            UserWarning,
            stacklevel=2,
        )
    else:
        warnings.warn(
            "rollout_recovery.allow_restart_only_gym_servers=true, but every Gym agent and resources server that "
            "serves a turn-level rollout saves its rollouts; set it to false so a restart-only server added later "
            f"fails setup instead of silently losing {level}-level recovery "
            f"(rollout_recovery.target_level={level}; rollouts that come back by replay count as saved)",
            UserWarning,
            stacklevel=2,
        )


def policy_unreachable_retry_s(config: MasterConfig) -> float:
    """How long Gym's model servers send a call again while the generation worker cannot be reached: the
    generation recovery's bound when it runs (docs/design.md §5.12), else 0 (the call fails at once)."""
    in_run = config.rollout_recovery.in_run
    return in_run.timeout_s if in_run.enabled and config.policy.model_name != SCRIPTED_TEST_BACKEND else 0.0


def _spinup_gym(
    config: MasterConfig,
    *,
    policy_base_url: str,
    log_dir: str | Path,
    rows: list[dict[str, Any]] | None = None,
    control_auth_token: str | None = None,
    hooks: RunHooks | None = None,
) -> NemoGymShardSet:
    """Start one ``NemoGym`` actor per shard replica, discover restart-only servers, check.

    ``rows`` (the training data) decide each agent's recovery level through the
    per-agent and per-task-source overrides; without them every agent has
    ``target_level``. A restart-only check that refuses the setup goes to
    ``hooks.on_restart_only_servers`` (the product's default raises it).
    """
    env = config.env.nemo_gym
    turn = config.rollout_recovery.turn_checkpointing_enabled
    token = control_auth_token or secrets.token_urlsafe(24)
    server_types: dict[str, str] = {}
    shard_turn_users: dict[str, dict[str, list[str]]] = {}  # shard -> server -> turn-level agents using it
    shard_set = NemoGymShardSet(handles={}, instances={}, agent_shards={})
    try:
        _check_ray_resources(env)
        for shard in env.shards:
            gym_cfg = build_gym_actor_config(
                shard_gym_config(env, shard),
                policy_base_url=policy_base_url,
                control_auth_token=token,
                checkpointing=turn,
                storage_writer=config.checkpointing.storage_writer,
                policy_unreachable_retry_s=policy_unreachable_retry_s(config),
            )
            parsed = parse_gym_config(gym_cfg)
            replay = replay_agents(parsed) if turn else {}
            if replay:  # their model servers keep each call, so a lost rollout can be replayed (§4.8)
                gym_cfg = with_call_records(gym_cfg, parsed)
                parsed = parse_gym_config(gym_cfg)
            shard_set.replay_models[shard.name] = replay
            shard_set.agent_resources[shard.name] = _agent_resources(parsed)
            shard_turn_users[shard.name] = turn_level_users(config.rollout_recovery, rows or [],
                                                            _agent_resources(parsed), replayed=replay)
            shard_set.agent_servers[shard.name] = _agent_servers(parsed)
            _register_servers(parsed, shard.name, server_types, shard_set.agent_shards)
            _add_shard(config, shard, gym_cfg, shard_set, token=token, log_dir=log_dir)
        asyncio.run(_start_all(shard_set, env.spinup_timeout_s + 60))
        write_json_atomic(Path(log_dir) / "gym_placement.json", shard_set.placement)
        if turn:
            _discover_and_check(config, shard_set, server_types, shard_turn_users, hooks)
    except BaseException:
        shard_set.shutdown()
        raise
    return shard_set


def _agent_resources(parsed: Any) -> dict[str, str | None]:
    """Agent -> the resources server it uses (None without one): what ``turn_level_users`` needs to
    tell which servers a turn-level rollout passes through. Split out of ``_spinup_gym``."""
    return {
        name: ((inst.config.get("resources_server") or {}).get("name") or None)
        for name, inst in parsed.instances.items()
        if inst.server_type == "responses_api_agents"
    }


def _agent_servers(parsed: Any) -> dict[str, list[str]]:
    """Agent -> the Gym servers its rollouts touch (itself, its model and resources servers), so a
    server's restart-only status can be tied to the agents it affects. Split out of ``_spinup_gym``."""
    return {
        name: sorted({name, *(((inst.config.get(key) or {}).get("name")) for key in
                              ("model_server", "resources_server") if (inst.config.get(key) or {}).get("name"))})
        for name, inst in parsed.instances.items()
        if inst.server_type == "responses_api_agents"
    }


def _register_servers(parsed: Any, shard_name: str, server_types: dict[str, str], agent_shards: dict[str, str]) -> None:
    """Record each server's type and each agent's shard, refusing an agent configured in two shards
    (rollouts are routed to a shard by agent name). Split out of ``_spinup_gym``."""
    for name, inst in parsed.instances.items():
        server_types[name] = inst.server_type
        if inst.server_type == "responses_api_agents":
            if name in agent_shards and agent_shards[name] != shard_name:
                raise GymConfigError(f"Gym agent {name!r} is configured in shards {agent_shards[name]!r} and {shard_name!r}")
            agent_shards[name] = shard_name


def _add_shard(config: MasterConfig, shard: ShardConfig, gym_cfg: dict[str, Any], shard_set: NemoGymShardSet,
               *, token: str, log_dir: str | Path) -> None:
    """Register ``shard``'s replicas and how each starts (``ReplicaSpec``: a lost one starts again from it,
    docs/design.md §5.12); ``_start_all`` starts them. Split out of ``_spinup_gym``."""
    spec = ReplicaSpec(
        gym_config=gym_cfg, ray_resources=dict(shard.ray_resources), control_auth_token=token,
        log_dir=str(log_dir), rollout_timeout_s=config.async_rl.rollout_failure.nemo_gym.rollout_timeout_s,
        spinup_timeout_s=config.env.nemo_gym.spinup_timeout_s,
        with_control=config.rollout_recovery.turn_checkpointing_enabled,
    )
    shard_set.specs[shard.name] = spec
    shard_set.handles[shard.name] = [None] * shard.replicas
    for i in range(shard.replicas):
        inst_id = GymCheckpointInstance(shard.name, i)
        shard_set.instances[inst_id.instance_id] = inst_id


async def _start_all(shard_set: NemoGymShardSet, timeout_s: float) -> None:
    """Every registered replica at once (``start_replica``, as a replacement starts), under one deadline;
    the first failure names its replica and stops the others (each leaves nothing running)."""
    async def one(iid: str) -> None:
        inst = shard_set.instances[iid]
        try:
            shard_set.install(iid, await start_replica(shard_set.specs[inst.shard_name], inst))
        except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as exc:
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            if isinstance(cause, (GymConfigError, ValueError)):
                raise type(cause)(f"Gym shard replica {iid}: {cause}") from None
            raise ShardSetupError(f"Gym shard replica {iid}: could not start it: {cause}") from None

    try:
        async with asyncio.timeout(timeout_s), asyncio.TaskGroup() as tasks:
            for iid in shard_set.instances:
                tasks.create_task(one(iid), name=f"gym-start:{iid}")
    except TimeoutError:
        missing = sorted(iid for iid in shard_set.instances if iid not in shard_set.placement)
        raise ShardSetupError(f"Gym shard replica {', '.join(missing)}: could not start it within "
                              f"{timeout_s:.0f}s") from None
    except BaseExceptionGroup as group:
        raise _first(group) from None


def _first(group: BaseExceptionGroup) -> BaseException:
    """The error that stopped the start (not the cancellations it caused)."""
    for exc in group.exceptions:
        inner = _first(exc) if isinstance(exc, BaseExceptionGroup) else exc
        if not isinstance(inner, asyncio.CancelledError):
            return inner
    return group.exceptions[0]


def _discover_and_check(config: MasterConfig, shard_set: NemoGymShardSet, server_types: dict[str, str],
                        shard_turn_users: dict[str, dict[str, list[str]]], hooks: RunHooks | None) -> None:
    """From the restart-only servers each replica's control actor found as it started, derive their
    prepare policies and run the restart-only check (a refusal goes to ``hooks.on_restart_only_servers``;
    docs/design.md §5.2). Split out of ``_spinup_gym``: only turn-level checkpointing needs it."""
    turn_users = {iid: shard_turn_users[inst.shard_name] for iid, inst in shard_set.instances.items()}
    shard_set.prepare_policy_overrides = {
        iid: prepare_policy_overrides(shard_set.restart_only_servers[iid], turn_users[iid])
        for iid in shard_set.restart_only_servers
    }
    try:
        restart_only_check(config, shard_set.restart_only_servers, server_types, turn_users)
    except ValueError as refused:
        (hooks or RunHooks()).on_restart_only_servers(refused)


def _check_ray_resources(env: NemoGymEnvConfig) -> None:
    """Fail at once, naming the shard and resource, if the cluster cannot hold every replica
    (instead of waiting out ``spinup_timeout_s`` for actors that can never be placed)."""
    wanted: dict[str, float] = {}
    askers: dict[str, list[str]] = {}
    for shard in env.shards:
        for name, amount in shard.ray_resources.items():
            wanted[name] = wanted.get(name, 0.0) + amount * shard.replicas
            askers.setdefault(name, []).append(f"{shard.name} ({shard.replicas} x {amount:g})")
    if not wanted:
        return
    offered = ray.cluster_resources()
    short = {name: amount for name, amount in wanted.items() if offered.get(name, 0.0) < amount}
    if short:
        raise ShardSetupError("; ".join(
            f"Gym shards {', '.join(askers[name])} ask for {amount:g} of Ray resource {name!r}, but the cluster "
            f"offers {offered.get(name, 0.0):g} (is a node missing?)" for name, amount in sorted(short.items())
        ))
