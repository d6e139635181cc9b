"""Where the time from launch to the first rollout goes (``startup.json``).

A relaunch after a crash should reach its first dispatched rollout in seconds;
this records each phase so a slow one is visible: Python and config, Ray, Gym
servers, the policy and generation backend, the trainer checkpoint load, the
snapshot restore, and the first dispatch. Times are seconds since the process
started (read from ``/proc`` on Linux, so interpreter start-up and imports count).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from nemo_rl.utils.atomic_write import write_bytes_atomic

PHASES = ("config", "ray", "gym", "model", "trainer_load", "restore", "first_dispatch")


def process_start_time() -> float:
    """Wall-clock time this process started (now, where /proc cannot tell).

    From the process's start in clock ticks since boot and the system's uptime
    (``/proc/stat``'s ``btime`` is whole seconds and would add up to a second)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of stat, counted after the command name
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


class StartupClock:
    """Marks phases once; writes ``startup.json`` when the first rollout is dispatched."""

    def __init__(self, log_dir: str | Path | None = None, *, resumed: bool | None = None):
        self.path = None if log_dir is None else Path(log_dir) / "startup.json"
        self.started = process_start_time()
        self.marks: dict[str, float] = {}
        self.resumed = resumed
        self.written = False

    def mark(self, phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown startup phase {phase!r}; phases: {PHASES}")
        if phase not in self.marks:
            self.marks[phase] = time.time() - self.started
        if phase == "first_dispatch":
            self.write()

    def phases(self) -> dict[str, float]:
        """Duration of each phase reached (a phase's time runs from the previous mark)."""
        out, previous = {}, 0.0
        for phase in PHASES:
            if phase in self.marks:
                out[phase] = round(self.marks[phase] - previous, 3)
                previous = self.marks[phase]
        return out

    def write(self) -> None:
        if self.path is None or self.written:
            return
        self.written = True
        record = {
            "resumed": self.resumed,
            "to_first_dispatch_s": round(self.marks.get("first_dispatch", time.time() - self.started), 3),
            "phases_s": self.phases(),
        }
        write_bytes_atomic(self.path, (json.dumps(record, indent=1, sort_keys=True) + "\n").encode())
