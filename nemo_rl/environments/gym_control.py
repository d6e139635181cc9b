"""``NemoGymControl``: one Gym replica's checkpoint calls, in a process of their own (docs/design.md §5.4).

Why a process: a replica's ``NemoGym`` actor sends a step's thousands of ``/run`` calls from its
event-loop thread, which then holds the GIL most of the time. A checkpoint call answered on another
thread of that process waited for the GIL at every step of its three round trips: burst prepares
took 0.3-1.2 s while the Gym servers answered in under 0.1 s (measured while it was built;
the current burst figures are docs/benchmarks.md §1c). Here the
calls run in a Ray actor that does nothing else.

Lifetime: the replica's ``NemoGym`` actor creates it (``NemoGym.start_control``) on its own node
(the servers listen on loopback) and owns it, so Ray ends it when the replica actor dies: a
checkpoint call then raises ``RayActorError`` as it did when the calls ran in the replica actor, and
the controller names the lost replica (``GymReplicaLost``). ``NemoGym.shutdown`` ends it first.
The server processes are not its children: it tells a dead or stopped server by its pid
(``ServerProcesses``).
"""

from __future__ import annotations

import os
import time
from typing import Any, Awaitable

import ray

from gym_patches.checkpoint.calls import GymCall, ProbeCall
from gym_patches.checkpoint.coordination import CoordinationError
from gym_patches.server_utils import ServerClient
from gym_patches.utils.processes import process_state
from nemo_rl.environments.gym_checkpoint_adapter import (
    GymCheckpointAdapter,
    GymCheckpointInstance,
    GymCheckpointReply,
    GymServerProbe,
)

# Checkpoint calls of one replica that may run at once (a probe beside a prepare, retries).
CONTROL_CONCURRENCY = 32
# A server silent to a status probe that used this share of a core meanwhile is busy, not hung.
BUSY_CPU_SHARE = 0.1


class ServerProcesses:
    """A deployment's server processes by pid, read from ``/proc``: works from any process on their node."""

    def __init__(self, pids: dict[str, int]):
        self.pids = dict(pids)

    def states(self) -> dict[str, tuple[str, float]]:
        """Each live server's state letter and CPU seconds so far (an exited one, zombie or gone, is left out)."""
        out = {}
        for name, pid in self.pids.items():
            state = process_state(pid)
            if state is not None and state[0] not in ("Z", "X"):
                out[name] = state
        return out

    def dead(self) -> list[str]:
        """Servers whose process has exited."""
        live = self.states()
        return sorted(name for name in self.pids if name not in live)


@ray.remote(max_restarts=0, num_cpus=0, max_concurrency=CONTROL_CONCURRENCY)
class NemoGymControl:
    """The checkpoint entry of one replica (``checkpoint``) and its participant discovery."""

    def __init__(self, instance: GymCheckpointInstance, server_config: Any, control_auth_token: str,
                 pids: dict[str, int]):
        self.instance = instance
        self.processes = ServerProcesses(pids)
        self.client = ServerClient(server_config)  # made on this actor's loop, used only there
        self.adapter = GymCheckpointAdapter(instance, self.client, control_auth_token)

    def pid(self) -> int:
        return os.getpid()

    async def discover(self, timeout_s: float = 30.0) -> list[str]:
        """Discover the replica's checkpoint participants; returns the restart-only server names."""
        return await self.adapter.discover(timeout_s=timeout_s)

    async def checkpoint(self, request: GymCall) -> GymCheckpointReply:
        """Run ``request`` over the replica's servers (the adapter says what each request answers). A
        failure caused by a server process that is gone names it; a probe also says which servers are
        dead, stopped or busy, which only a process on their node can see."""
        if not isinstance(request, ProbeCall):
            return await self._named(self.adapter.checkpoint(request))
        before, t0 = self.processes.states(), time.monotonic()
        reply = await self._named(self.adapter.checkpoint(request))
        return self._with_process_state(reply, before, time.monotonic() - t0)

    def _with_process_state(self, probes: dict[str, GymServerProbe], before: dict[str, tuple[str, float]],
                            elapsed_s: float) -> dict[str, GymServerProbe]:
        """A dead server's probe says it is dead; a silent one's says when its process is stopped, or
        that it is busy: it used at least ``BUSY_CPU_SHARE`` of a core while the probe waited (at
        thousands of rollouts an agent can be too busy to answer in time; docs/design.md §5.8)."""
        for name in self.processes.dead():
            if name in probes:
                probes[name] = GymServerProbe(False, f"Gym server {name!r} is dead (its process exited)")
        for name, (state, cpu_s) in self.processes.states().items():
            probe = probes.get(name)
            if probe is None or probe.answered:
                continue
            if state in ("T", "t"):
                probes[name] = GymServerProbe(False, f"{probe.detail} (its process is stopped)")
                continue
            share = (cpu_s - before[name][1]) / elapsed_s if name in before and elapsed_s > 0 else 0.0
            if share >= BUSY_CPU_SHARE:
                probes[name] = GymServerProbe(False, f"{probe.detail} (busy: its process ran {share:.0%} of a "
                                              "core meanwhile)", busy=True)
        return probes

    async def _named(self, call: Awaitable[Any]) -> Any:
        """A checkpoint call; if it failed because a server process is gone, the error says which one."""
        try:
            return await call
        except CoordinationError as exc:
            dead = self.processes.dead()
            if not dead:
                raise
            names = ", ".join(repr(name) for name in dead)
            message = f"Gym server {names} of {self.instance.instance_id} is dead (its process exited); {exc}"
            raise CoordinationError(dead[0], exc.status, "server_dead", message, message=message) from None
