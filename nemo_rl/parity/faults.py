"""The faults the parity harness drives, their spec (``--faults``), and when each is due.

A spec is a comma-separated list, delivered in order, each once the one before it is over (a relaunch has
committed a snapshot, an in-run loss has its row in ``recoveries.jsonl``)::

    kill                     SIGKILL of the whole run (every process of it), then the same command again
    kill:replicas=1          ... relaunched with every Gym shard at 1 replica (elastic restore)
    term                     SIGTERM to the driver (its final snapshot, exit 143), then a relaunch
    term:replicas=1          ... relaunched on another replica count
    server[:<name>]          SIGKILL of one Gym server (default: the first of the replica's, by name)
    stop[:<name>]            SIGSTOP of one Gym server (default: the last), until the run replaces it
    replica                  SIGKILL of a Gym replica: its actor and its servers at once
    worker                   SIGKILL of the generation worker

An in-run fault (server, stop, replica) may name its replica with ``@<shard>/replica-<i>`` (default: the
run's last replica). The harness's seed draws, for each fault, the trained steps it waits for (the faults
spread over the run, in order) and then the committed snapshots that saved rollouts (for an in-run Gym
fault: saved some on its replica) it waits for, 1 or 2: the faults land at random committed snapshots.
"""

from __future__ import annotations

import random
import signal
from dataclasses import dataclass, field

KINDS: dict[str, str] = {
    "kill": "SIGKILL of the whole run, then a relaunch",
    "term": "SIGTERM to the driver, then a relaunch",
    "server": "SIGKILL of a Gym server",
    "stop": "SIGSTOP of a Gym server",
    "replica": "SIGKILL of a Gym replica (its actor and servers)",
    "worker": "SIGKILL of the generation worker",
}
RELAUNCH = frozenset({"kill", "term"})
IN_RUN_GYM = frozenset({"server", "stop", "replica"})


@dataclass
class Fault:
    kind: str
    server: str | None = None  # server / stop: the Gym server's name (None: chosen from the run's logs)
    replica: str | None = None  # in-run Gym faults: the target replica (None: the run's last)
    replicas: int | None = None  # kill / term: relaunch with every shard at this many replicas
    after_steps: int = 0  # trained steps (their records written) before it is armed
    after_snapshots: int = 1  # then committed snapshots (that saved rollouts) to wait for before it is due
    spec: str = ""

    @property
    def relaunches(self) -> bool:
        return self.kind in RELAUNCH

    @property
    def in_run(self) -> bool:
        return not self.relaunches

    @property
    def signal(self) -> int:
        return {"term": signal.SIGTERM, "stop": signal.SIGSTOP}.get(self.kind, signal.SIGKILL)

    def describe(self) -> str:
        what = KINDS[self.kind]
        if self.server:
            what += f" ({self.server})"
        if self.replica and self.kind in IN_RUN_GYM:
            what += f" on {self.replica}"
        if self.replicas is not None:
            what += f" on {self.replicas} replica(s)"
        return what


@dataclass
class Schedule:
    faults: list[Fault] = field(default_factory=list)

    @property
    def in_run(self) -> bool:
        return any(f.in_run for f in self.faults)

    def describe(self) -> list[str]:
        return [f"{i + 1}. {f.spec}: {f.describe()}, once {f.after_steps} step(s) trained, after "
                f"{f.after_snapshots} committed snapshot(s)" for i, f in enumerate(self.faults)]


def parse_fault(item: str) -> Fault:
    """One item of a spec; ``ValueError`` naming the item and what is allowed."""
    text = item.strip()
    body, _, replica = text.partition("@")
    kind, _, arg = body.partition(":")
    if kind not in KINDS:
        raise ValueError(f"--faults: unknown fault {text!r}; kinds: {', '.join(KINDS)}")
    fault = Fault(kind, spec=text, replica=replica or None)
    if replica and kind not in IN_RUN_GYM:
        raise ValueError(f"--faults: {text!r}: only server, stop and replica name a replica (@<shard>/replica-<i>)")
    if kind in RELAUNCH and arg:
        key, _, value = arg.partition("=")
        if key != "replicas" or not value.isdigit() or int(value) < 1:
            raise ValueError(f"--faults: {text!r}: a relaunch takes replicas=<N >= 1>, e.g. {kind}:replicas=1")
        fault.replicas = int(value)
    elif kind in ("server", "stop"):
        fault.server = arg or None
    elif arg:
        raise ValueError(f"--faults: {text!r}: {kind} takes no argument")
    return fault


def default_spec(replicas: int) -> str:
    """One of each kind, mixed, with a relaunch on another replica count: what runs with no ``--faults``."""
    other = replicas - 1 if replicas > 1 else replicas + 1
    return f"server,replica,kill,worker,stop,kill,term:replicas={other}"


def parse_schedule(spec: str, seed: int = 0, steps: int = 1) -> Schedule:
    """The spec's faults in order; ``seed`` draws the trained steps each waits for (spread over the run's
    ``steps``, in order) and then 1 or 2 committed snapshots."""
    items = [p for p in spec.split(",") if p.strip()]
    if not items:
        raise ValueError("--faults: no fault given")
    rng = random.Random(seed)
    faults = [parse_fault(p) for p in items]
    for f, after in zip(faults, sorted(rng.randrange(max(1, steps)) for _ in faults)):
        f.after_steps, f.after_snapshots = after, rng.choice((1, 2))
    return Schedule(faults)
