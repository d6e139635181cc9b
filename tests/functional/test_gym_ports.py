"""Gym servers get their ports without a race: the launcher binds each ``port: 0`` and keeps it
listening until the server that serves it has started on that very socket."""

from __future__ import annotations

import errno
import socket
import urllib.request

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
        assert set(sockets) == {"head_server", "sandbox", "verifier"}
        for name, sock in sockets.items():
            port = ported.head_server.port if name == "head_server" else ported.instances[name].port
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
    with GymDeployment.start(config(port=fixed), log_dir=tmp_path) as dep:
        assert dep.url("sandbox").endswith(f":{fixed}")
        with urllib.request.urlopen(dep.url("sandbox") + "/health", timeout=5) as resp:
            assert resp.status == 200
