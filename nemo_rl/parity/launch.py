"""Start a GRPO run as a process of its own, stop it the ways a machine or a scheduler would, start it again.

A launch is ``<entry> [--config X] key=value ...`` (the product's ``python -m nemo_rl.cli.run_grpo`` unless
the caller names another entry) in its own session, with the run's marker in its environment
(``processes.MARKER_ENV``), its stdout and stderr in ``<root>/launch-<n>.out``. Whole-run faults act on
it: ``kill_all`` (SIGKILL of its process group and of every process carrying the marker: a machine
that dies), ``terminate`` (SIGTERM to the driver alone, as a scheduler's stop). ``reap`` waits until no
process of the run is left.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from nemo_rl.parity import processes

PRODUCT_ENTRY = (sys.executable, "-m", "nemo_rl.cli.run_grpo")


@dataclass
class RunPlace:
    """Where one run writes: ``<root>/logs`` (``logger.log_dir``) and ``<root>/ckpt`` (checkpoints)."""

    root: Path

    def __post_init__(self) -> None:
        self.root = Path(self.root)

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def ckpt(self) -> Path:
        return self.root / "ckpt"

    def overrides(self) -> list[str]:
        return [f"logger.log_dir={self.logs}", f"checkpointing.checkpoint_dir={self.ckpt}", "grpo.deterministic=true"]


@dataclass
class RunCommand:
    """The run's command line, the same for every launch but for the overrides a fault adds."""

    config: str | None
    overrides: list[str]
    entry: tuple[str, ...] = PRODUCT_ENTRY
    env: dict[str, str] | None = None  # the launch's environment (None: this process's)
    cwd: Path = field(default_factory=Path.cwd)

    def argv(self, place: RunPlace, extra: list[str]) -> list[str]:
        config = ["--config", self.config] if self.config else []
        return [*self.entry, *config, *self.overrides, *place.overrides(), *extra]


class Launch:
    """One start of a run; ``returncode`` once it has exited."""

    def __init__(self, command: RunCommand, place: RunPlace, n: int, extra: list[str], marker: str):
        self.n, self.marker, self.place = n, marker, place
        self.out_path = place.root / f"launch-{n}.out"
        place.root.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ if command.env is None else command.env)
        env[processes.MARKER_ENV] = marker
        self.argv = command.argv(place, extra)
        self.started = time.monotonic()
        with open(self.out_path, "wb") as out:
            self.proc = subprocess.Popen(self.argv, cwd=command.cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def kill_all(self) -> None:
        """SIGKILL of the whole run: its process group and every process with its marker."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        processes.send({str(p): p for p in processes.run_processes(self.marker)}, signal.SIGKILL)
        self.proc.wait(timeout=60)

    def terminate(self, wait_s: float) -> int | None:
        """SIGTERM to the driver; its exit status, or None if it did not exit within ``wait_s`` (then the
        whole run is killed)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            self.kill_all()
            return None

    def tail(self, lines: int = 15) -> str:
        """The output's last ``lines`` lines, a line repeated in a row shown once with its count."""
        try:
            text = self.out_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        runs: list[list] = []
        for line in text:
            if runs and runs[-1][0] == line:
                runs[-1][1] += 1
            else:
                runs.append([line, 1])
        return "\n".join(line if n == 1 else f"{line}  [x{n}]" for line, n in runs[-lines:])


def new_marker() -> str:
    return uuid.uuid4().hex
