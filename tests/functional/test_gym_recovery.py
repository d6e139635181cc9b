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
        if len(read_jsonl(self.spec.logs / "recoveries.jsonl")) < len(self.sent):
            return False  # the last loss is not recovered yet
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


def test_two_shards_with_restart_only_servers_only_their_rollouts_restart_from_the_prompt(tmp_path):
    """Two shards of two replicas; one server lost on a replica of each shard at once. The saving shard's
    rollouts continue at their turn; only the restart-only shard's go back to their prompt."""
    spec = cm.RunSpec(tmp_path / "run", config=TWO_SHARDS, keep_latest_k=100, prompts=4, generations=2,
                      extra=["checkpointing.keep_top_k=100"])
    saving = Fault(spec, "workplace_assistant", replica="saving/replica-1")
    mixed = Fault(spec, "python_sandbox", replica="mixed/replica-1")

    def tick(elapsed: float) -> bool:
        if not saving.sent:
            saving.tick(elapsed)
            if saving.sent and server_pids(spec.logs, "mixed/replica-1"):
                mixed.snapshot = saving.snapshot
                mixed.sent.append((time.time(), {"python_sandbox": server_pids(spec.logs, "mixed/replica-1")
                                                 ["python_sandbox"]}))
                os.kill(mixed.sent[0][1]["python_sandbox"], signal.SIGKILL)
        return False

    result = cm.Runner(spec).run(kill_when=tick, timeout_s=360)
    assert saving.sent and mixed.sent, "no committed snapshot held rollouts on saving/replica-1"
    assert result.returncode == 0, result.stderr[-5000:]
    assert result.restore is None and cm.check_lineage(spec) == [] and not result.leftover
    rows = {r["instance"]: r for r in read_jsonl(spec.logs / "recoveries.jsonl")}
    assert set(rows) == {"saving/replica-1", "mixed/replica-1"}, rows
    kept = rows["saving/replica-1"]
    held = set(turn_level(kept["snapshot"])["saving/replica-1"])
    assert kept["continued_turn"] and set(kept["continued_turn"]) <= held, kept
    assert not set(kept["restarted_from_prompt"]) & held, kept
    lost = rows["mixed/replica-1"]  # restart-only servers: nothing of theirs is ever saved
    assert lost["part"] == "python_sandbox" and lost["action"] == "restarted", lost
    assert lost["continued_turn"] == [] and lost["continued_prefix"] == [], lost


def test_a_server_stopped_for_good_is_recovered_after_the_bound_not_the_call_timeout(tmp_path):
    spec, fault, result = run_with_fault(
        tmp_path, dict(target="workplace_assistant", sig=signal.SIGSTOP),
        extra=["rollout_recovery.in_run.hung_after_s=3"])
    rows = check_recovery_rows(spec, fault, result, part="workplace_assistant", action="restarted")
    assert rows[0]["cause"].startswith("stopped for "), rows[0]
    steps = read_jsonl(spec.logs / "metrics.jsonl")
    assert max(m["step_s"] for m in steps) < 60, [m["step_s"] for m in steps]  # not the 300 s call timeout


def test_a_crash_loop_gives_the_replica_up_and_moves_its_rollouts_to_the_other(tmp_path):
    """Recovered once; lost again within the window: given up, its saved rollouts continue on replica-0."""
    spec, fault, result = run_with_fault(
        tmp_path, dict(target="workplace_assistant", times=2), steps=4,
        extra=["rollout_recovery.in_run.max_recoveries=1"])
    assert len(fault.sent) == 2, fault.sent
    assert result.returncode == 0, result.stderr[-5000:]
    assert result.restore is None and cm.check_lineage(spec) == [] and not result.leftover
    rows = read_jsonl(spec.logs / "recoveries.jsonl")
    assert [r["action"] for r in rows] == ["restarted", "moved"], rows
    assert "max_recoveries=1" in rows[1]["given_up"], rows[1]
    assert not server_pids(spec.logs, REPLICA), "the given-up replica's servers still run"


def test_a_crash_loop_on_the_only_replica_stops_the_run_naming_the_server_and_its_log(tmp_path):
    spec, fault, result = run_with_fault(
        tmp_path, dict(target="workplace_assistant", replica="nemo_gym/replica-0", times=3), steps=6,
        config="examples/configs/grpo_workplace_turn.yaml", extra=["rollout_recovery.in_run.max_recoveries=2"])
    assert len(fault.sent) == 3, (fault.sent, result.stderr[-3000:])
    assert result.returncode == 1, result.stderr[-5000:]
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, result.stderr[-5000:]
    assert "'workplace_assistant' of nemo_gym/replica-0" in errors[0] and "max_recoveries=2" in errors[0], errors
    log = spec.logs / "gym-instances" / "nemo_gym" / "replica-0" / "workplace_assistant.log"
    assert str(log) in errors[0] or str(log.resolve()) in errors[0], errors
    assert "Traceback" not in result.stderr
    assert not result.leftover
    assert len(read_jsonl(spec.logs / "recoveries.jsonl")) == 2


def test_async_lookahead_one_a_killed_server_is_recovered(tmp_path):
    spec, fault, result = run_with_fault(tmp_path, dict(target="workplace_assistant"), lookahead=1, shuffle=False)
    check_recovery_rows(spec, fault, result, part="workplace_assistant", action="restarted")
