"""Run a config to its end while a fault schedule strikes it from outside (``faults.Schedule``).

The driver watches what the run writes (``trained/``, ``snapshots.jsonl``, ``recoveries.jsonl``, each
snapshot's ``gym_checkpoint.json``) and acts by signals on pids (``processes``): it knows nothing of how the
run recovers. A fault is *armed* once the previous one is over (a relaunch fault when the same command has
been started again, an in-run fault when ``recoveries.jsonl`` has a new row) and ``after_steps`` steps have
their trained-samples record; it is *due* once ``after_snapshots`` committed snapshots that saved rollouts
(for an in-run Gym fault: saved some on its replica) appeared since it was armed. Each delivered fault is a
line of ``<root>/faults.jsonl`` (what, when, the pids it hit, the snapshot it followed);
``<root>/faults_state.json`` says at every moment how many were delivered, whether the next is armed and
whether an in-run fault's recovery is awaited.
Faults left when the run ends are reported, not silently dropped.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from nemo_rl.parity import processes
from nemo_rl.parity.faults import Fault, Schedule
from nemo_rl.parity.launch import Launch, RunCommand, RunPlace, new_marker
from nemo_rl.parity.trace import read_step_traces_steps
from nemo_rl.utils.jsonl_rows import read_rows

FAULT_LOG = "faults.jsonl"
FAULT_STATE = "faults_state.json"
POLL_S = 0.1
# At prefix level a relaunch or a worker loss waits for a snapshot that cut a call in flight (so a cut is
# continued), unless this many snapshots that saved rollouts came without one (a backend without cuts).
PREFIX_CUT_PATIENCE = 10


@dataclass
class DriveOutcome:
    launches: list[dict[str, Any]] = field(default_factory=list)  # n, argv, returncode, wall_s, output
    delivered: list[dict[str, Any]] = field(default_factory=list)
    undelivered: list[str] = field(default_factory=list)
    error: str | None = None


class FaultDriver:
    """Runs ``command`` at ``place`` to its end under ``schedule``."""

    def __init__(self, command: RunCommand, place: RunPlace, schedule: Schedule, *, shards: list[str],
                 prefix: bool = False, launch_timeout_s: float = 3600.0, stop_wait_s: float = 60.0,
                 log: Callable[[str], None] = print):
        self.command, self.place, self.schedule, self.shards = command, place, schedule, shards
        self.prefix = prefix
        self.launch_timeout_s, self.stop_wait_s, self.log = launch_timeout_s, stop_wait_s, log
        self.marker = new_marker()
        self.extra: list[str] = []  # overrides a relaunch fault added (sticky)
        self.outcome = DriveOutcome()
        self._turn_levels: dict[str, dict[str, list[str]]] = {}
        self._stopped: list[int] = []
        # _since: committed snapshots when the next fault was armed (None: not armed); _waiting_for: the
        # recoveries.jsonl rows an in-run fault's recovery must reach before the next is armed
        self._since: int | None = None
        self._waiting_for: int | None = None

    # ------------------------------------------------------------------ what the run wrote
    def _committed(self) -> list[dict[str, Any]]:
        return [r for r in read_rows(self.place.logs / "snapshots.jsonl") if r.get("committed")]

    def _turn_level(self, path: str | None) -> dict[str, list[str]]:
        """A committed snapshot's saved rollouts per replica, read once as it appears (it may be pruned)."""
        if not path:
            return {}
        if path not in self._turn_levels:
            try:
                data = json.loads((Path(path) / "gym_checkpoint.json").read_text())
                self._turn_levels[path] = dict(data.get("turn_level") or {})
            except (OSError, ValueError):
                self._turn_levels[path] = {}
        return self._turn_levels[path]

    def _recoveries(self) -> int:
        return len(read_rows(self.place.logs / "recoveries.jsonl"))

    def _trained(self) -> int:
        """The newest step with a trained-samples record (written before its checkpoint and refit)."""
        return max(read_step_traces_steps(self.place.logs), default=0)

    def _state(self, pending: list[Fault]) -> None:
        """``faults_state.json``, replaced atomically: delivered so far, whether the next is armed, and whether
        an in-run fault's recovery is awaited (``busy``: armed or recovering)."""
        armed, recovering = self._since is not None, self._waiting_for is not None
        state = {"delivered": len(self.outcome.delivered), "armed": armed, "recovering": recovering,
                 "busy": armed or recovering, "next": pending[0].spec if pending else None,
                 "faults": len(self.schedule.faults)}
        tmp = self.place.root / f".{FAULT_STATE}.tmp"
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.place.root / FAULT_STATE)

    def _target_replica(self, fault: Fault) -> str | None:
        found = processes.replicas(self.place.logs)
        return fault.replica or (found[-1] if found else None)

    def _due(self, fault: Fault, since: int) -> dict[str, Any] | None:
        """The snapshot after which ``fault`` is due, or None yet."""
        rows = [r for r in self._committed()[since:] if r.get("saved", 0) > 0]
        if fault.kind in ("server", "stop", "replica"):
            replica = self._target_replica(fault)
            rows = [r for r in rows if self._turn_level(r.get("path")).get(replica)]
        elif self.prefix:
            with_cuts = [r for r in rows if r.get("cuts", 0) > 0]
            rows = with_cuts if with_cuts or len(rows) < PREFIX_CUT_PATIENCE else rows
        return rows[fault.after_snapshots - 1] if len(rows) >= fault.after_snapshots else None

    # ------------------------------------------------------------------ acting
    def _pids_for(self, fault: Fault) -> dict[str, int]:
        logs = self.place.logs
        if fault.kind == "worker":
            pid = processes.generation_worker(logs)
            return {} if pid is None else {"generation worker": pid}
        replica = self._target_replica(fault)
        if replica is None:
            return {}
        servers = processes.replica_servers(logs, replica)
        if fault.kind == "replica":
            actor = processes.parent_pid(next(iter(servers.values()))) if servers else None
            return {} if actor is None else {"actor": actor, **servers}  # the actor first, then its servers
        names = sorted(n for n in servers if n != processes.HEAD_SERVER)  # the head only publishes the config
        name = fault.server or ((names[0] if fault.kind == "server" else names[-1]) if names else None)
        return {name: servers[name]} if name in servers else {}

    def _launch(self) -> Launch:
        n = len(self.outcome.launches) + 1
        launch = Launch(self.command, self.place, n, list(self.extra), self.marker)
        self.outcome.launches.append({"n": n, "argv": launch.argv, "returncode": None, "output": str(launch.out_path)})
        self.log(f"launch {n}: {' '.join(launch.argv)}")
        return launch

    def _ended(self, launch: Launch, returncode: int | None) -> None:
        row = self.outcome.launches[-1]
        row["returncode"], row["wall_s"] = returncode, round(launch.elapsed(), 1)

    def _record(self, fault: Fault, n: int, hit: dict[str, int], after: dict[str, Any]) -> None:
        row = {"n": n, "fault": fault.spec, "what": fault.describe(), "time": time.time(), "pids": hit,
               "launch": len(self.outcome.launches), "after_snapshot": after.get("path"),
               "after_step": after.get("step")}
        self.outcome.delivered.append(row)
        with open(self.place.root / FAULT_LOG, "a") as out:
            out.write(json.dumps(row) + "\n")
        self.log(f"fault {n}: {fault.describe()} (pids {hit}) after {after.get('path')}")

    def _relaunch_fault(self, launch: Launch, fault: Fault) -> int | None:
        """Deliver a whole-run fault; returns the exit status it caused (None: killed)."""
        if fault.kind == "kill":
            launch.kill_all()
            status = None
        else:
            status = launch.terminate(self.stop_wait_s)
        self._ended(launch, status if status is not None else launch.returncode)
        left = processes.reap(self.marker)
        if left:
            self.log(f"after the {fault.kind}: {len(left)} process(es) of the run outlived it and were killed")
        if fault.replicas is not None:
            self.extra = [o for o in self.extra if ".replicas=" not in o]
            self.extra += [f"env.nemo_gym.shards.{i}.replicas={fault.replicas}" for i in range(len(self.shards))]
        return status

    # ------------------------------------------------------------------ the loop
    def _stopped_by_itself(self, launch: Launch) -> bool:
        """The launch exited (an error unless 0) or ran past its time (killed, an error): the loop ends."""
        code = launch.returncode
        if code is not None:
            self._ended(launch, code)
            if code != 0:
                self.outcome.error = f"launch {launch.n} exited with {code}:\n{launch.tail()}"
            return True
        if launch.elapsed() > self.launch_timeout_s:
            launch.kill_all()
            self._ended(launch, None)
            self.outcome.error = f"launch {launch.n} ran past {self.launch_timeout_s:g} s:\n{launch.tail()}"
            return True
        return False

    def _arm(self, faults: list[Fault]) -> None:
        """Arm the next fault once the previous one is over and its steps are trained."""
        if self._waiting_for is not None and self._recoveries() >= self._waiting_for:
            self._waiting_for = None
            self._state(faults)
        if faults and self._waiting_for is None and self._since is None and self._trained() >= faults[0].after_steps:
            self._since = len(self._committed())
            self._state(faults)

    def _deliver_due(self, launch: Launch, faults: list[Fault]) -> Launch:
        """Deliver the armed fault if it is due; returns the launch running afterwards (a relaunch's)."""
        if not faults or self._since is None:
            return launch
        fault = faults[0]
        after = self._due(fault, self._since)
        pids = self._pids_for(fault) if after is not None and fault.in_run else {}
        if after is None or not (fault.relaunches or pids):
            return launch
        faults.pop(0)
        n, self._since = len(self.outcome.delivered) + 1, None
        if fault.relaunches:
            status = self._relaunch_fault(launch, fault)
            self._record(fault, n, {"driver": launch.proc.pid, "exit": status}, after)
            launch = self._launch()
        else:
            self._waiting_for = self._recoveries() + 1
            hit = processes.send(pids, fault.signal)
            if fault.signal == signal.SIGSTOP:
                self._stopped += list(hit.values())
            self._record(fault, n, hit, after)
        self._state(faults)
        return launch

    def run(self) -> DriveOutcome:
        faults = list(self.schedule.faults)
        launch = self._launch()
        self._state(faults)
        try:
            while not self._stopped_by_itself(launch):
                self._arm(faults)
                launch = self._deliver_due(launch, faults)
                time.sleep(POLL_S)
        finally:
            if launch.returncode is None:
                launch.kill_all()
            processes.send({str(p): p for p in self._stopped}, signal.SIGCONT)
            processes.reap(self.marker)
        self.outcome.undelivered = [f.spec for f in faults]
        return self.outcome
