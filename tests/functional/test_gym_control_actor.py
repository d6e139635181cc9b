"""A replica's checkpoint calls run in its own ``NemoGymControl`` actor (docs/design.md §5.4), with real
Ray actors and a real Gym deployment (policy model in front of the scripted backend, Workplace, two
agents).

Checked: the control actor is a process of its own, neither the replica's ``NemoGym`` actor nor a Gym
server; it answers a status probe while the replica actor's process is stopped (SIGSTOP: the case the
separate process exists for, a replica actor that cannot run Python meanwhile); it names a stopped
server in its probe from the pid alone (the servers are not its children); and it ends with the
replica actor (Ray fate-shares an actor with its owner), so a checkpoint call then raises
``RayActorError`` and the controller can name the lost replica.
"""

from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager
from typing import Any, Iterator

import pytest

from gym_patches.checkpoint.calls import ProbeCall
from gym_patches.fakes.scripted_backend import ScriptedBackend
from gym_patches.utils.processes import process_state
from nemo_rl.environments.gym_checkpoint_adapter import GymCheckpointInstance
from tests.functional.test_gym_stalls import ROWS, TOKEN, gym_config, sigstop

pytestmark = [pytest.mark.functional, pytest.mark.timeout(180)]

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture
def replica(ray_local, tmp_path) -> Iterator[tuple[Any, Any]]:
    """A spun-up ``NemoGym`` replica actor and its control actor; torn down whatever the test did."""
    from nemo_rl.environments.nemo_gym import NemoGym

    with ScriptedBackend().start() as backend:
        backend.plans_from_rows(ROWS)
        actor = NemoGym.remote(GymCheckpointInstance("s", 0), gym_config(backend.base_url),
                               control_auth_token=TOKEN, log_dir=str(tmp_path))
        try:
            ray.get(actor.spinup.remote(60.0), timeout=90)
            restart_only, control = ray.get(actor.start_control.remote(), timeout=60)
            assert restart_only == ["plain"], restart_only  # discovered through the control actor
            yield actor, control
        finally:
            try:
                ray.get(actor.shutdown.remote(), timeout=30)
            except ray.exceptions.RayError:
                pass  # the test killed it: its servers went with it (parent-death signal)
            ray.kill(actor)


@contextmanager
def sigstopped(pid: int) -> Iterator[None]:
    try:
        sigstop(pid)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _probe(control: Any, timeout_s: float = 2.0) -> dict[str, Any]:
    return ray.get(control.checkpoint.remote(ProbeCall(timeout_s=timeout_s)), timeout=timeout_s + 30)


def test_the_control_actor_is_a_process_of_its_own_that_answers_while_the_replica_actor_is_stopped(replica):
    actor, control = replica
    actor_pid, control_pid = ray.get(actor.ping.remote()), ray.get(control.pid.remote())
    servers = ray.get(actor.server_pids.remote())
    assert control_pid != actor_pid and control_pid not in servers.values()
    assert all(p.answered for p in _probe(control).values())
    with sigstopped(actor_pid):
        assert process_state(actor_pid)[0] in ("T", "t")
        probes = _probe(control)
    assert set(probes) == {"policy_model", "workplace", "simple", "plain"}, sorted(probes)
    assert all(p.answered for p in probes.values()), probes


def test_a_stopped_server_is_named_from_its_pid(replica):
    actor, control = replica
    pid = ray.get(actor.server_pids.remote())["workplace"]
    with sigstopped(pid):
        probes = _probe(control, timeout_s=1.0)
    assert not probes["workplace"].answered and "(its process is stopped)" in probes["workplace"].detail, probes
    assert all(p.answered for name, p in probes.items() if name != "workplace"), probes


def test_the_control_actor_ends_with_its_replica_actor(replica):
    actor, control = replica
    control_pid = ray.get(control.pid.remote())
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + 60
    while (state := process_state(control_pid)) is not None and state[0] not in ("Z", "X"):
        assert time.monotonic() < deadline, "the control actor outlived its replica actor"
        time.sleep(0.2)
    with pytest.raises(ray.exceptions.RayActorError):
        _probe(control)
