"""``NemoGym``: one Ray actor per Gym shard replica.

Each actor starts its own Gym deployment (a head server plus one process per
server, on loopback) and runs rollouts over HTTP. Its checkpoint calls
(``gym_patches.checkpoint.calls``) run in a second actor it owns,
``gym_control.NemoGymControl``, through one Ray method, ``checkpoint``, so they
never wait on the GIL of the thread sending ``/run`` calls. ``NemoGymShardSet`` is
the controller's handle on all of them.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from gym_patches.checkpoint.calls import GymCall
from gym_patches.checkpoint.wire import RestartOnlyPolicy
from gym_patches.checkpoint.storage import StorageWriterSpec
from gym_patches.config import GymConfigError, parse_gym_config
from gym_patches.launch import GymDeployment
from gym_patches.server_catalog import check_servers
from gym_patches.server_utils import ServerCallError, ServerClient
from gym_patches.activity import fetch_activity
from gym_patches.wire_models import ROLLOUT_ID_FIELD, AgentActivity, RunError, RunErrorBody, RunReply
from nemo_rl.environments.gym_watch import describe_exit, first_exit, processes_gone, watch_servers
from nemo_rl.environments.gym_checkpoint_adapter import GymCheckpointInstance
from nemo_rl.environments.gym_control import NemoGymControl, ServerProcesses


class GymRolloutError(RuntimeError):
    """A rollout did not finish. ``infra`` = a server failed (retry from the prompt). ``detail``: what became
    of ``server`` when its process exited (``died (exit -9, SIGKILL)``), for the in-run recovery's row."""

    def __init__(self, message: str, *, rollout_id: str, server: str, infra: bool, code: str | None = None,
                 detail: str | None = None):
        super().__init__(message)
        self.rollout_id, self.server, self.infra, self.code, self.detail = rollout_id, server, infra, code, detail

    def __reduce__(self):  # keeps the subclass across Ray: a refusal (``GymCheckpointParked``) stays one
        return (_rebuild_rollout_error,
                (type(self), str(self), self.rollout_id, self.server, self.infra, self.code, self.detail))


def _rebuild_rollout_error(cls, message, rollout_id, server, infra, code, detail=None):
    return cls(message, rollout_id=rollout_id, server=server, infra=infra, code=code, detail=detail)


def parse_run_error(body: Any) -> RunError | None:
    """The error of a failed ``/run`` (code, detail, and the Gym server that failed), if it has the shape."""
    try:
        return RunErrorBody.model_validate(body).error
    except ValidationError:
        return None


class GymReplicaLost(RuntimeError):
    """A Gym replica's Ray actor died (its node was lost, or the actor crashed): the run stops, naming it.

    Nothing a committed snapshot holds is lost: the same command resumes from the newest
    snapshot once the replica can be placed again (e.g. the node is back), or at once on
    fewer replicas of its shard, whose saved rollouts then continue on the shard's other
    replicas (elastic restore, docs/design.md §5.7).
    """

    def __init__(self, instance: str, cause: BaseException, node: dict[str, str] | None = None):
        detail = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        where = f" (Ray node {node['node_id']}, {node['ip']})" if node else ""
        shard = instance.rsplit("/replica-", 1)[0]
        super().__init__(
            f"Gym replica {instance}{where} was lost: its Ray actor died ({detail}). The run stops; run the same "
            "command again once its node is back: it resumes from the newest committed snapshot. To go on "
            f"without the node, run it with fewer replicas of shard {shard!r} (lower its `replicas` in "
            "env.nemo_gym.shards, e.g. env.nemo_gym.shards.<index>.replicas=<n>): the rollouts saved on replicas "
            "that no longer run continue on the shard's other replicas"
        )
        self.instance, self.node = instance, node


class GymCheckpointParked(GymRolloutError):
    """A ``/run`` refused because a checkpoint holds the agent closed; dispatch again later."""


def build_gym_actor_config(
    gym_config: dict[str, Any], *, policy_base_url: str, control_auth_token: str, checkpointing: bool,
    storage_writer: StorageWriterSpec | None = None, policy_unreachable_retry_s: float = 0.0,
) -> dict[str, Any]:
    """The Gym config one replica runs: RL injects the policy URL (and how long a model server sends a
    call again while the generation worker behind it is being restarted) and the checkpoint block.

    Only ``checkpoint.lease_grace_seconds`` is the user's to set (RL owns
    ``enabled``, the token and the storage writer, ``checkpointing.storage_writer``).
    Every error names the Gym key, and every server's implementation config is
    checked here, in the driver, before any process starts.
    """
    cfg = dict(gym_config)
    cfg["policy_base_url"] = policy_base_url
    cfg["policy_unreachable_retry_s"] = float(policy_unreachable_retry_s)
    cfg["head_server"] = {"host": "127.0.0.1", "port": 0}
    cfg["checkpoint"] = {
        "enabled": bool(checkpointing),
        "control_auth_token": control_auth_token,
        "lease_grace_seconds": _lease_grace_seconds(gym_config.get("checkpoint")),
    }
    if storage_writer is not None:
        cfg["checkpoint"]["storage_writer"] = storage_writer.model_dump(mode="json")
    check_servers(parse_gym_config(cfg))  # fail here, in the driver, with the key named (no server imported)
    return cfg


_RL_OWNED_CHECKPOINT_KEYS = ("enabled", "control_auth_token")


def _lease_grace_seconds(block: Any) -> float:
    if block is None:
        return 600.0
    if not isinstance(block, dict):
        raise GymConfigError(f"Gym config key 'checkpoint' must be a mapping, got {type(block).__name__}")
    unknown = sorted(set(block) - {"lease_grace_seconds", *_RL_OWNED_CHECKPOINT_KEYS})
    if unknown:
        raise GymConfigError(
            f"Gym config key(s) {', '.join(f'checkpoint.{k}' for k in unknown)} do not exist; under RL only "
            "checkpoint.lease_grace_seconds may be set (RL sets checkpoint.enabled and the control token, and "
            "the storage writer from checkpointing.storage_writer)"
        )
    value = block.get("lease_grace_seconds", 600.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise GymConfigError(
            f"Gym config key checkpoint.lease_grace_seconds must be a positive number of seconds, got {value!r}"
        )
    return float(value)


# Rollouts (``/run`` calls held across a checkpoint) in flight in one replica. Checkpoint calls go
# to the replica's ``NemoGymControl``, so they never queue behind these (they are what releases them).
ROLLOUT_CONCURRENCY = 100_000
# How long a replica that failed to answer is passed over for new rollouts (while its shard has another).
UNHEALTHY_FOR_S = 60.0


@ray.remote(max_restarts=0, num_cpus=0, max_concurrency=ROLLOUT_CONCURRENCY)
class NemoGym:
    """One Gym deployment, its rollouts and its control actor, for one shard replica."""

    def __init__(
        self,
        instance: GymCheckpointInstance,
        gym_config: dict[str, Any],
        *,
        control_auth_token: str,
        log_dir: str,
        rollout_timeout_s: float = 1800.0,
    ):
        self.instance = instance
        self.gym_config = gym_config
        self.control_auth_token = control_auth_token
        self.log_dir = Path(log_dir) / "gym-instances" / instance.shard_name / f"replica-{instance.replica_index}"
        self.rollout_timeout_s = rollout_timeout_s
        self.deployment: GymDeployment | None = None
        self.client: ServerClient | None = None  # rollouts
        self.control: Any = None  # the NemoGymControl actor this one owns (``start_control``)
        self.closing = False  # shutdown began: a /run that fails now failed because of it

    async def spinup(self, startup_timeout_s: float = 60.0) -> list[dict[str, str]]:
        # Started from the actor's event-loop thread, which lives as long as the
        # actor, so the servers' parent-death signal fires only when it dies.
        self.deployment = GymDeployment.start(self.gym_config, log_dir=self.log_dir, startup_timeout_s=startup_timeout_s)
        self.client = ServerClient(self.deployment.config)
        return [
            {"name": s.name, "kind": s.kind, "url": s.url, "checkpoint_mode": s.checkpoint_mode}
            for s in self.deployment.servers
        ]

    async def start_control(self, timeout_s: float = 30.0) -> tuple[list[str], Any]:
        """Start this replica's ``NemoGymControl`` (its checkpoint calls, in a process of their own, on
        this node, owned by this actor) and discover the participants through it. Returns the
        restart-only server names and the control actor's handle."""
        assert self.deployment is not None, "spinup() first"
        if self.control is None:
            here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
            self.control = NemoGymControl.options(scheduling_strategy=here).remote(
                self.instance, self.deployment.config, self.control_auth_token, self._pids())
        return await self.control.discover.remote(timeout_s), self.control

    async def run_rollout(self, row: dict[str, Any], rollout_id: str) -> dict[str, Any] | None:
        """POST the row to its agent's ``/run`` under ``rollout_id`` (a capture key).

        None: this replica shut down under the call (``NemoGymShardSet.run_rollout`` raises for a
        caller still waiting). At a stop thousands of calls end at once; an exception each would have
        Ray format thousands of tracebacks while the run's grace runs out (docs/design.md §5.11)."""
        assert self.client is not None, "spinup() first"
        agent = (row.get("agent_ref") or {}).get("name")
        if not agent:
            raise GymRolloutError(
                f"row {row.get('id')!r} has no agent_ref.name", rollout_id=rollout_id, server="?", infra=False
            )
        body = dict(row)
        body[ROLLOUT_ID_FIELD] = rollout_id
        try:
            try:
                resp = await self.client.post(agent, "/run", json=body, timeout_s=self.rollout_timeout_s)
            except Exception:
                if self.closing:
                    return None
                raise
        except ServerCallError as exc:
            await self._settle_exits()
            raise self._infra_error(str(exc), rollout_id, agent) from None
        except TimeoutError:
            raise self._infra_error(
                f"Gym agent {agent!r} /run for {rollout_id} did not answer within {self.rollout_timeout_s:g}s "
                f"(async_rl.rollout_failure.nemo_gym.rollout_timeout_s)", rollout_id, agent, "rollout_timeout",
            ) from None
        if resp.status == 200:
            return RunReply.model_validate(resp.body).model_dump()
        error = parse_run_error(resp.body)
        code = error.code if error is not None else None
        message = f"Gym agent {agent!r} /run for {rollout_id} returned {resp.status}: {resp.text[:300]}"
        if code == "admission_closed":
            raise GymCheckpointParked(message, rollout_id=rollout_id, server=agent, infra=False, code=code)
        if resp.status >= 500:
            await self._settle_exits()
            # The server that failed is the one the agent names (its resources or model server), not the agent.
            raise self._infra_error(message, rollout_id, (error.server if error is not None else None) or agent, code)
        raise GymRolloutError(message, rollout_id=rollout_id, server=agent, infra=False, code=code)

    async def _settle_exits(self, within_s: float = 0.5) -> None:
        """A call that lost its connection may beat its server's exit by a moment (the socket closes
        before the process exits): wait for a server's exit, told by its pidfd, at most ``within_s``, so
        the error names the dead server."""
        if not self.dead_servers():
            await first_exit(list(self._pids().values()), within_s)

    def _infra_error(self, message: str, rollout_id: str, server: str, code: str | None = None) -> GymRolloutError:
        """A failed ``/run``, blaming ``server``; if a server process of this deployment has exited or
        is stopped, name it instead (it explains the failure better than the call that noticed)."""
        dead = self.dead_servers()
        if not dead:
            stopped = self.stopped_servers()
            if stopped:
                names = ", ".join(repr(name) for name in stopped)
                return GymRolloutError(
                    f"Gym server {names} of {self.instance.instance_id} is stopped (not answering); {message}",
                    rollout_id=rollout_id, server=stopped[0], infra=True, code=code or "server_stopped",
                )
            return GymRolloutError(message, rollout_id=rollout_id, server=server, infra=True, code=code)
        names = ", ".join(repr(name) for name in dead)
        return GymRolloutError(
            f"Gym server {names} of {self.instance.instance_id} is dead (its process exited); {message}",
            rollout_id=rollout_id, server=dead[0], infra=True, code="server_dead",
            detail=f"died ({describe_exit(self.deployment.exit_code(dead[0]))})",
        )

    async def activity(self, timeout_s: float) -> dict[str, AgentActivity | str]:
        """Each agent's runs in flight and what they wait on, or why the agent did not answer."""
        assert self.client is not None, "spinup() first"
        agents = [name for name, inst in self.deployment.config.instances.items()
                  if inst.server_type == "responses_api_agents"]
        return await fetch_activity(self.client, agents, timeout_s)

    def dead_servers(self) -> list[str]:
        """Servers of this deployment whose process has exited."""
        if self.deployment is None:
            return []
        return sorted(name for name, ok in self.deployment.alive().items() if not ok)

    def stopped_servers(self) -> list[str]:
        """Servers whose process is stopped (SIGSTOP, a debugger): alive, but answering nothing."""
        if self.deployment is None:
            return []
        states = ServerProcesses(self._pids()).states()
        return sorted(name for name, (state, _) in states.items() if state in ("T", "t"))

    def failing_servers(self) -> list[str]:
        """Servers whose process has exited or is stopped: the watch reports each (§5.12)."""
        return sorted({*self.dead_servers(), *self.stopped_servers()})

    def _pids(self) -> dict[str, int]:
        assert self.deployment is not None
        return {name: self.deployment.pid(name) for name in ["head_server", *self.deployment.config.instances]}

    async def watch(self, hung_after_s: float) -> dict[str, Any]:
        """Return when one of this replica's servers is lost (exited, stopped or silent for
        ``hung_after_s``; ``gym_watch.watch_servers``), saying which and why. The controller awaits one
        per replica (docs/design.md §5.12)."""
        assert self.deployment is not None, "spinup() first"
        deployment = self.deployment
        pids = self._pids()
        urls = {name: deployment.url(name) for name in pids}
        loss = await watch_servers(pids, lambda name: deployment.exit_code(name), urls, hung_after_s)
        return {**loss.as_dict(), "log": str(self.log_dir / f"{loss.server}.log"),
                "log_tail": deployment.log_tail(loss.server, 20)}

    # -- lifecycle ---------------------------------------------------------------
    async def server_pids(self) -> dict[str, int]:
        return self._pids()

    async def kill_server(self, name: str) -> None:
        assert self.deployment is not None
        self.deployment.kill_server(name)

    async def shutdown(self) -> None:
        self.closing = True
        if self.control is not None:  # first: no checkpoint call reaches servers being stopped
            ray.kill(self.control)
            self.control = None
        if self.client is not None:
            await self.client.close()
        if self.deployment is not None:
            self.deployment.stop()
            self.deployment = None

    def ping(self) -> int:
        return os.getpid()

    def where(self) -> dict[str, Any]:
        """The Ray node this replica (and its Gym server processes) runs on, and this actor's pid there
        (``gym_placement.json``: where to look for a replica's processes)."""
        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "actor_pid": os.getpid()}


@dataclass(frozen=True)
class ReplicaSpec:
    """What starting one replica of a shard takes, kept so a lost one can be started again
    (docs/design.md §5.12)."""

    gym_config: dict[str, Any]
    ray_resources: dict[str, float]
    control_auth_token: str
    log_dir: str
    rollout_timeout_s: float
    spinup_timeout_s: float
    with_control: bool  # turn-level checkpointing: start its NemoGymControl

    def new_actor(self, instance: GymCheckpointInstance) -> Any:
        return NemoGym.options(name=None, resources=dict(self.ray_resources) or None).remote(
            instance, self.gym_config, control_auth_token=self.control_auth_token, log_dir=self.log_dir,
            rollout_timeout_s=self.rollout_timeout_s,
        )


class ReplicaNotPlaced(RuntimeError):
    """Ray did not place a new replica in time (its node, or the resources it asks for, are gone)."""


@dataclass(frozen=True)
class StartedReplica:
    """A replica whose servers are up: its actor, its control actor (turn-level checkpointing only), the
    restart-only servers the control actor found, the Ray node it runs on and its servers' pids."""

    handle: Any
    control: Any
    restart_only: list[str]
    where: dict[str, Any]  # node_id, ip, actor_pid and (with a control actor) control_pid
    pids: dict[str, int]


async def start_replica(spec: ReplicaSpec, instance: GymCheckpointInstance,
                        placement_timeout_s: float | None = None) -> StartedReplica:
    """The one way a replica starts, at setup and when a lost one is replaced: a new ``NemoGym`` actor,
    its Gym deployment, and its control actor when the run checkpoints at turn level. ``placement_timeout_s``
    (a replacement): ``ReplicaNotPlaced`` when Ray does not place the actor within it. A start that fails or
    is cancelled leaves nothing running."""
    handle, control = spec.new_actor(instance), None
    try:
        if placement_timeout_s is not None:
            try:
                await asyncio.wait_for(handle.ping.remote(), placement_timeout_s)
            except TimeoutError:
                raise ReplicaNotPlaced(
                    f"Ray did not place a new {instance.instance_id} within {placement_timeout_s:g} s "
                    f"(rollout_recovery.in_run.placement_timeout_s; resources {spec.ray_resources or 'none'})"
                ) from None
        await handle.spinup.remote(spec.spinup_timeout_s)
        where = await handle.where.remote()
        restart_only: list[str] = []
        if spec.with_control:
            restart_only, control = await handle.start_control.remote()
            where = {**where, "control_pid": await control.pid.remote()}
        pids = await handle.server_pids.remote()
    except BaseException:
        kill_replica(handle, control)
        raise
    return StartedReplica(handle, control, sorted(restart_only), where, pids)


def kill_replica(handle: Any, control: Any) -> None:
    """End a replica's actors, the control actor first (no checkpoint call reaches servers that die); its
    servers die with their actor (their parent-death signal)."""
    for actor in (control, handle):
        if actor is not None:
            ray.kill(actor, no_restart=True)


@dataclass
class NemoGymShardSet:
    """All replicas of all shards; ``restart_only_servers`` is filled by setup."""

    handles: dict[str, list[Any]]
    instances: dict[str, GymCheckpointInstance]
    agent_shards: dict[str, str] = field(default_factory=dict)  # agent name -> shard
    restart_only_servers: dict[str, list[str]] = field(default_factory=dict)  # instance id -> names
    # shard -> agent -> the Gym servers its rollouts touch (itself, its model and resources servers)
    agent_servers: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    # instance id -> {node_id, ip}: the Ray node each replica runs on (gym_placement.json)
    placement: dict[str, dict[str, str]] = field(default_factory=dict)
    # instance id -> server -> prepare policy, for restart-only servers no turn-level rollout passes through
    prepare_policy_overrides: dict[str, dict[str, RestartOnlyPolicy]] = field(default_factory=dict)
    # instance id -> (when, why) it last failed to answer: new rollouts go elsewhere while others are healthy
    unhealthy: dict[str, tuple[float, str]] = field(default_factory=dict)
    _cycle: dict[str, int] = field(default_factory=dict, repr=False)  # shard -> next replica index
    # instance id -> its NemoGymControl (checkpoint calls), once setup started it (``NemoGym.start_control``)
    control_handles: dict[str, Any] = field(default_factory=dict)
    specs: dict[str, ReplicaSpec] = field(default_factory=dict)  # shard -> how its replicas start (§5.12)
    recovering: set[str] = field(default_factory=set)  # replicas being recovered: no new rollout goes there
    # shard -> agent -> its model server, for agents whose rollouts come back by replay (docs/design.md §4.8)
    replay_models: dict[str, dict[str, str]] = field(default_factory=dict)
    agent_resources: dict[str, dict[str, str | None]] = field(default_factory=dict)  # shard -> agent -> resources
    server_pids: dict[str, dict[str, int]] = field(default_factory=dict)  # instance id -> server -> pid

    @property
    def checkpoint_handles(self) -> dict[str, Any]:
        """Every running replica (a replica given up, its slot None, is left out)."""
        return {
            GymCheckpointInstance(shard, i).instance_id: h
            for shard, hs in self.handles.items()
            for i, h in enumerate(hs)
            if h is not None
        }

    def shard_of(self, instance_id: str) -> str:
        return self.instances[instance_id].shard_name

    def survivors(self, instance_id: str) -> list[str]:
        """The other running replicas of ``instance_id``'s shard."""
        shard = self.shard_of(instance_id)
        return [iid for iid in self.checkpoint_handles
                if iid != instance_id and self.instances[iid].shard_name == shard]

    def install(self, instance_id: str, started: StartedReplica) -> None:
        """``started`` takes ``instance_id``'s slot (setup, or a replacement)."""
        inst = self.instances[instance_id]
        self.handles[inst.shard_name][inst.replica_index] = started.handle
        if started.control is not None:
            self.control_handles[instance_id] = started.control
            self.restart_only_servers[instance_id] = started.restart_only
        self.placement[instance_id] = started.where
        self.server_pids[instance_id] = started.pids

    async def replace(self, instance_id: str, placement_timeout_s: float, gone_within_s: float) -> dict[str, Any]:
        """Stop the replica (its servers die with its actor), wait until its processes on this host are
        gone (``gone_within_s``: a successor never starts beside them), and start a new one in its slot
        (``start_replica``: same name and config, ports of its own). Returns where it runs;
        ``ReplicaNotPlaced`` when Ray cannot place it within ``placement_timeout_s``."""
        inst = self.instances[instance_id]
        self._stop_slot(instance_id)
        left = await processes_gone(self._local_pids(instance_id), gone_within_s)
        if left:
            raise TimeoutError(f"the old processes of {instance_id} ({', '.join(map(str, left))}) were still "
                               f"running {gone_within_s:.1f} s after its actor was killed")
        started = await start_replica(self.specs[inst.shard_name], inst, placement_timeout_s)
        self.install(instance_id, started)
        return started.where

    def drop(self, instance_id: str) -> None:
        """Give a replica up: its actors are stopped and its slot left empty (no rollout goes there again). It
        stays in ``recovering`` until its recovery has moved its rollouts (the ledger holds them there until
        then; a snapshot meanwhile leaves it out as being recovered, instead of meeting rollouts on a replica
        outside the topology)."""
        self._stop_slot(instance_id)
        self.placement.pop(instance_id, None)

    def _stop_slot(self, instance_id: str) -> None:
        inst = self.instances[instance_id]
        kill_replica(self.handles[inst.shard_name][inst.replica_index], self.control_handles.pop(instance_id, None))
        self.handles[inst.shard_name][inst.replica_index] = None  # until a new one is in: no dead slot

    def _local_pids(self, instance_id: str) -> list[int]:
        """The replica's server pids, if it ran on this host (a pid elsewhere says nothing here)."""
        where = self.placement.get(instance_id) or {}
        if where.get("node_id") != _this_node():
            return []
        return list(self.server_pids.get(instance_id, {}).values())

    def handle_for(self, instance_id: str) -> Any:
        try:
            return self.checkpoint_handles[instance_id]
        except KeyError:
            raise KeyError(f"no Gym instance {instance_id!r}; have {sorted(self.checkpoint_handles)}") from None

    async def run_rollout(self, instance_id: str, row: dict[str, Any], rollout_id: str) -> dict[str, Any]:
        """One rollout on one replica (``NemoGym.run_rollout``); its reply as a dict."""
        reply = await self.handle_for(instance_id).run_rollout.remote(row, rollout_id)
        if reply is None:
            raise GymRolloutError(f"Gym instance {instance_id} shut down while rollout {rollout_id} ran",
                                  rollout_id=rollout_id, server="?", infra=True, code="shutting_down")
        return reply

    def send_checkpoint(self, instance_id: str, request: GymCall) -> Any:
        """Start ``request`` on one replica's one checkpoint entry (its ``NemoGymControl``); returns the
        Ray object ref."""
        control = self.control_handles.get(instance_id)
        if control is None:
            raise KeyError(f"Gym instance {instance_id!r} has no control actor (started for turn-level "
                           f"checkpointing only); have {sorted(self.control_handles)}")
        return control.checkpoint.remote(request)

    def checkpoint_dir(self, instance_id: str, root: str | Path) -> str:
        """Where the servers of ``instance_id`` write a checkpoint rooted at ``root``."""
        try:
            return str(self.instances[instance_id].checkpoint_dir(root))
        except KeyError:
            raise KeyError(f"no Gym instance {instance_id!r}; have {sorted(self.instances)}") from None

    def pick_instance(self, agent_name: str) -> str | None:
        """Round-robin over the running replicas of the shard serving ``agent_name``, skipping replicas
        that recently failed to answer while the shard has a healthy one. None: every replica of the
        shard is being recovered (the rollout waits for one)."""
        shard = self.agent_shards.get(agent_name)
        if shard is None:
            raise KeyError(f"no Gym shard serves agent {agent_name!r}; agents: {sorted(self.agent_shards)}")
        count = len(self.handles[shard])
        start = self._cycle.get(shard, 0)
        self._cycle[shard] = (start + 1) % count
        usable = [iid for offset in range(count)
                  if self.handles[shard][(start + offset) % count] is not None
                  and (iid := GymCheckpointInstance(shard, (start + offset) % count).instance_id)
                  not in self.recovering]
        for iid in usable:
            if not self.is_unhealthy(iid):
                return iid
        return usable[0] if usable else None  # every replica is unhealthy: keep spreading

    def mark_unhealthy(self, instance_id: str, why: str) -> None:
        self.unhealthy[instance_id] = (time.monotonic(), why)

    def mark_healthy(self, instance_id: str) -> None:
        self.unhealthy.pop(instance_id, None)

    def is_unhealthy(self, instance_id: str) -> bool:
        """Marked within the last ``UNHEALTHY_FOR_S`` (a replica that answers again is cleared sooner)."""
        mark = self.unhealthy.get(instance_id)
        return mark is not None and time.monotonic() - mark[0] < UNHEALTHY_FOR_S

    def shutdown(self) -> None:
        running = list(self.checkpoint_handles.values())
        refs = [h.shutdown.remote() for h in running]
        try:
            ray.get(refs, timeout=30)
        except Exception:  # noqa: BLE001 - best effort on the way out; the kill below is certain
            pass
        for h in running:
            ray.kill(h, no_restart=True)


def _this_node() -> str | None:
    """The Ray node this process runs on (None without Ray)."""
    try:
        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - no Ray here: nothing is local to compare with
        return None
