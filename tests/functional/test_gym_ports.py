"""Gym servers get their ports without a race: the launcher binds each ``port: 0`` (and each server's
control listener, ``control_port``) and keeps it listening until the server that serves it has
started on that very socket."""

from __future__ import annotations

import errno
import json
import socket
import urllib.request

import yaml

import pytest

from gym_patches.config import parse_gym_config
from gym_patches.launch import GymDeployment, _assign_ports

pytestmark = pytest.mark.functional


def config(port: int = 0) -> dict:
    return {"sandbox": {"resources_servers": {"python_sandbox": {"port": port, "exec_timeout_s": 5}}},
            "verifier": {"resources_servers": {"arithmetic_verifier": {}}}}


def test_assigned_ports_stay_taken_until_handed_over():
    ported, sockets = _assign_ports(parse_gym_config(config()))
    try:
        assert set(sockets) == {"head_server", "sandbox", "verifier", "sandbox#control", "verifier#control"}
        for name, sock in sockets.items():
            server, _, control = name.partition("#")
            inst = ported.instances.get(server)
            port = ported.head_server.port if name == "head_server" else inst.control_port if control else inst.port
            assert sock.getsockname()[1] == port != 0
            with socket.socket() as other, pytest.raises(OSError) as info:
                other.bind(("127.0.0.1", port))  # what raced before: another process taking the port
            assert info.value.errno == errno.EADDRINUSE
    finally:
        for sock in sockets.values():
            sock.close()


def test_servers_serve_on_the_sockets_the_launcher_bound(tmp_path):
    with GymDeployment.start(config(), log_dir=tmp_path) as dep:
        assert dep._sockets == {}, "every socket was handed to its server and closed here"
        for name in ("head_server", "sandbox", "verifier"):
            with urllib.request.urlopen(dep.url(name) + "/health", timeout=5) as resp:
                assert resp.status == 200
        for name in ("sandbox", "verifier"):  # the same app on its control listener
            inst = dep.config.instances[name]
            assert inst.control_port not in (None, inst.port)
            with urllib.request.urlopen(inst.control_url + "/health", timeout=5) as resp:
                assert resp.status == 200
            # the port is the server's: nobody else can bind it while it runs
            port = int(dep.url(name).rsplit(":", 1)[1])
            with socket.socket() as other, pytest.raises(OSError):
                other.bind(("127.0.0.1", port))


def test_a_fixed_port_is_bound_by_its_server(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        fixed = probe.getsockname()[1]
    ported, sockets = _assign_ports(parse_gym_config(config(port=fixed)))
    for sock in sockets.values():
        sock.close()
    assert "sandbox" not in sockets and ported.instances["sandbox"].port == fixed
    assert "sandbox#control" not in sockets and ported.instances["sandbox"].control_port is None
    assert ported.instances["sandbox"].control_url == ported.instances["sandbox"].url  # control on its one port
    with GymDeployment.start(config(port=fixed), log_dir=tmp_path) as dep:
        assert dep.url("sandbox").endswith(f":{fixed}")
        with urllib.request.urlopen(dep.url("sandbox") + "/health", timeout=5) as resp:
            assert resp.status == 200


def test_the_control_routes_answer_on_the_control_listener_and_the_servers_publish_it(tmp_path):
    gym = {**config(), "checkpoint": {"enabled": True, "control_auth_token": "ports-test"}}
    with GymDeployment.start(gym, log_dir=tmp_path) as dep:
        sandbox = dep.config.instances["sandbox"]
        request = urllib.request.Request(sandbox.control_url + "/ng-control/v1/checkpoint/status",
                                         headers={"Authorization": "Bearer ports-test"})
        with urllib.request.urlopen(request, timeout=5) as resp:
            status = json.loads(resp.read())
        assert status["instance"] == "sandbox" and status["phase"] == "idle"
        # every server reads the control ports from the config the head publishes
        with urllib.request.urlopen(dep.head_url + "/global_config_dict_yaml", timeout=5) as resp:
            seen = parse_gym_config(yaml.safe_load(resp.read()))
        assert {n: i.control_url for n, i in seen.instances.items()} == \
            {n: i.control_url for n, i in dep.config.instances.items()}
