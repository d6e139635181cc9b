"""``cluster.ray_address`` that cannot be joined fails at once, naming the key (``setup.init_ray``): nothing
listens on the port, or the host is unknown. (A port that answers but is no Ray GCS, through the real
entry point: ``tests/functional/test_cli.py``.)"""

from __future__ import annotations

import socket

import pytest
import ray

from nemo_rl.algorithms.single_controller_utils.config import load_config
from nemo_rl.algorithms.single_controller_utils.setup import RayConnectError, init_ray


def test_nothing_listening_is_named_at_once():
    with socket.socket() as bound:  # bound, not listening: the connection is refused
        bound.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{bound.getsockname()[1]}"
        with pytest.raises(RayConnectError) as caught:
            init_ray(load_config(None, [f"cluster.ray_address={address}"]))
    assert str(caught.value).startswith(f"cluster.ray_address={address}: cannot join the Ray cluster: nothing "
                                        f"listens on {address} (connection refused)")
    assert not ray.is_initialized()


def test_an_unknown_host_is_named():
    with pytest.raises(RayConnectError, match=r"cluster.ray_address=no-such-host.invalid:6379: cannot join the Ray "
                                              r"cluster: unknown host 'no-such-host.invalid'"):
        init_ray(load_config(None, ["cluster.ray_address=no-such-host.invalid:6379"]))
    assert not ray.is_initialized()
