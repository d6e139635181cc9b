"""In-run recovery of Gym servers and replicas (docs/design.md §5.12), end to end: real ``run_grpo``
processes, real Ray actors, real Gym servers on 127.0.0.1, the scripted test backend and the
recording trainer (the checks are about recovery, not learning).

A part of replica-1 is lost right after a committed snapshot holds turn-level rollouts there: a
server SIGKILLed, the replica's actor SIGKILLed with its servers, a server SIGSTOPped for good, a
crash loop. Each run must go on by itself (exit 0, no relaunch), train every prompt group exactly
once, and write a ``recoveries.jsonl`` row whose lists match what the snapshot held: none of the
rollouts it saved there restarts from its prompt.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from gym_patches.config import CONFIG_PATH_ENV
from testkit.run_harness import read_jsonl
from tests.functional.rl_run import load_crash_matrix

pytestmark = [pytest.mark.functional, pytest.mark.timeout(420)]

cm = load_crash_matrix()
TWO_REPLICAS = "examples/configs/grpo_workplace_two_replicas_turn.yaml"
TWO_SHARDS = "examples/configs/grpo_mixed_two_shards_turn.yaml"
REPLICA = "nemo_gym/replica-1"


def server_pids(log_dir: Path, replica: str) -> dict[str, int]:
    """The Gym server processes of ``replica`` of the run logging under ``log_dir``, by server name:
    each one's stdout is its log file there (so only this test's run matches)."""
    logs = (log_dir / "gym-instances" / replica).resolve()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            out = Path(os.readlink(entry / "fd" / "1"))
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if out.parent != logs:
            continue
        for item in environ:
            if item.startswith(f"{CONFIG_PATH_ENV}=".encode()):
                found[item.split(b"=", 1)[1].decode()] = int(entry.name)
    return found


def turn_level(snapshot: str | Path) -> dict[str, list[str]]:
    return json.loads((Path(snapshot) / "gym_checkpoint.json").read_text())["turn_level"]


class Fault:
    """Once a committed snapshot holds turn-level rollouts on ``replica``, sends ``sig`` to ``target``
    (a server's name, or ``replica``: the replica's actor process and its servers, at once) -- up to
    ``times`` times, each after the replacement's servers are up. Ticked by the harness; never stops the run."""

    def __init__(self, spec, target: str, replica: str = REPLICA, sig: int = signal.SIGKILL, times: int = 1):
        self.spec, self.target, self.replica, self.sig, self.times = spec, target, replica, sig, times
        self.sent: list[tuple[float, dict[str, int]]] = []  # (when, the pids it hit)
        self.snapshot: str | None = None

    def tick(self, _elapsed: float) -> bool:
        if len(self.sent) >= self.times:
            return False
        if not self.sent:
            held = [s for s in read_jsonl(self.spec.logs / "snapshots.jsonl")
                    if s.get("committed") and s.get("path") and Path(s["path"]).is_dir()
                    and turn_level(s["path"]).get(self.replica)]
            if not held:
                return False
            self.snapshot = held[-1]["path"]
        pids = server_pids(self.spec.logs, self.replica)
        if self.sent and set(pids.values()) & {p for _, hit in self.sent for p in hit.values()}:
            return False  # the last loss is not recovered yet
        if not pids or (self.target != "replica" and self.target not in pids):
            return False
        hit = dict(pids) if self.target == "replica" else {self.target: pids[self.target]}
        if self.target == "replica":
            actor = _parent(next(iter(pids.values())))
            hit["actor"] = actor
        for pid in hit.values():
            try:
                os.kill(pid, self.sig)
            except ProcessLookupError:
                pass
        self.sent.append((time.time(), hit))
        return False

    def release(self) -> None:
        """SIGCONT whatever was stopped (a stopped process would outlive every reaper)."""
        if self.sig == signal.SIGSTOP:
            for _, hit in self.sent:
                for pid in hit.values():
                    try:
                        os.kill(pid, signal.SIGCONT)
                    except ProcessLookupError:
                        pass


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def run_with_fault(tmp_path: Path, fault_args: dict, *, config: str = TWO_REPLICAS, extra: list[str] = (),
                   **spec_kw):
    # Every snapshot is kept, so the one a recovery restored from can be read afterwards.
    spec = cm.RunSpec(tmp_path / "run", config=config, keep_latest_k=100,
                      extra=["checkpointing.keep_top_k=100", *extra], **spec_kw)
    fault = Fault(spec, **fault_args)
    try:
        result = cm.Runner(spec).run(kill_when=fault.tick, timeout_s=360)
    finally:
        fault.release()
    return spec, fault, result


def check_recovery_rows(spec, fault: Fault, result, *, part: str, action: str) -> list[dict]:
    """The run went on by itself and each recovery row matches the snapshot it restored from."""
    assert fault.sent, "no committed snapshot held rollouts on the replica before the run ended"
    assert result.returncode == 0, result.stderr[-5000:]
    assert result.restore is None  # no relaunch: the run never restored from disk
    assert cm.check_lineage(spec) == []
    assert not result.leftover
    rows = read_jsonl(spec.logs / "recoveries.jsonl")
    assert rows, result.stderr[-3000:]
    for row in rows:
        assert row["instance"] == fault.replica and row["part"] == part and row["action"] == action, row
        assert {"time", "cause", "snapshot", "continued_turn", "continued_prefix", "restarted_from_prompt",
                "seconds_to_redispatch"} <= set(row), row
        lines = [ln for ln in result.stderr.splitlines() if ln.startswith(f"recovered {fault.replica}:")]
        assert lines, result.stderr[-3000:]
    first = rows[0]
    assert first["snapshot"] is not None, first
    held = set(turn_level(first["snapshot"]).get(fault.replica, []))
    continued = set(first["continued_turn"]) | set(first["continued_prefix"])
    assert continued, first
    assert continued <= held, (continued - held, first)
    assert not set(first["restarted_from_prompt"]) & held, first  # nothing saved went back to its prompt
    assert first["seconds_to_redispatch"] is not None and first["seconds_to_redispatch"] < 60, first
    # Nothing failed as an infrastructure error on the lost replica: no rollout there retried from its prompt.
    retried = [ln for ln in result.stderr.splitlines() if f" of {fault.replica} (" in ln and "retrying" in ln]
    assert not retried, retried[:3]
    return rows


@pytest.mark.parametrize("server", ["workplace_assistant", "workplace_simple_agent", "policy_model"])
def test_a_killed_server_is_restarted_and_its_rollouts_continue_at_their_turn(tmp_path, server):
    spec, fault, result = run_with_fault(tmp_path, dict(target=server))
    rows = check_recovery_rows(spec, fault, result, part=server, action="restarted")
    assert "died (exit -9, SIGKILL)" in rows[0]["cause"], rows[0]
    assert f"recovered {REPLICA}: {server} died" in result.stderr


def test_a_killed_replica_actor_is_replaced_and_its_rollouts_continue(tmp_path):
    spec, fault, result = run_with_fault(tmp_path, dict(target="replica"))
    rows = check_recovery_rows(spec, fault, result, part="replica", action="replaced")
    assert "Ray actor died" in rows[0]["cause"], rows[0]
