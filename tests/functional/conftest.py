"""Fixtures the functional tests share."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray for one test module (2 CPUs; the repository on the workers' ``PYTHONPATH``)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}})
    yield
    ray.shutdown()
