"""Runs ``examples/run_grpo.py`` as a real process for RL-level tests, and reads its records."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from typing import Callable

from gym_patches.utils.processes import processes_with_env, wait_until_gone

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "run_grpo.py"


@dataclass
class RunDirs:
    root: Path

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def ckpt(self) -> Path:
        return self.root / "ckpt"

    def overrides(self) -> list[str]:
        return [f"logger.log_dir={self.logs}", f"checkpointing.checkpoint_dir={self.ckpt}", "logger.progress_bar=false"]

    def records(self, name: str) -> list[dict]:
        path = self.logs / name
        if not path.exists():
            return []
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]

    def restore_json(self) -> dict:
        return json.loads((self.logs / "restore.json").read_text())


def env_for(delay_s: float = 0.0, extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["NEMO_RL_SCRIPTED_DELAY_S"] = str(delay_s)
    env["RAY_AUTH_MODE"] = env.get("RAY_AUTH_MODE", "disabled")
    env.update(extra or {})
    return env


def run_grpo(args: list[str], *, env: dict, timeout_s: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=timeout_s, cwd=REPO
    )


def run_until_then_kill(args: list[str], *, env: dict, until: Callable[[], bool], timeout_s: float = 180) -> None:
    """Start a run in its own process group; SIGKILL the whole group once ``until()`` holds."""
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), *args], env=env, cwd=REPO, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not until():
            if proc.poll() is not None:
                raise AssertionError(f"run exited with {proc.returncode} before the kill condition held")
            if time.monotonic() > deadline:
                raise AssertionError("kill condition never held")
            time.sleep(0.05)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


def processes_with_marker(marker: str) -> list[int]:
    """PIDs whose environment carries ``NEMO_RL_TEST_RUN_ID=<marker>`` (every process a run started)."""
    return processes_with_env("NEMO_RL_TEST_RUN_ID", marker)


def wait_for_no_processes(marker: str, timeout_s: float = 30.0) -> list[int]:
    return wait_until_gone("NEMO_RL_TEST_RUN_ID", marker, timeout_s)
