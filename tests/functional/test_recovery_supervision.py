"""In-run recovery as one component (docs/design.md §5.12), end to end: real ``run_grpo`` processes, real Ray
actors, real Gym servers on 127.0.0.1, the scripted test backend and the recording trainer.

Each test makes one thing happen at a moment it waits for, never at a moment it hopes for: two replicas lost at
once (recovered side by side), a server stopped while its replica's snapshot persist is held open by a gated
storage writer (``testkit/write_gate.py``), a replacement whose start hangs (its new servers stopped as they
appear) when SIGTERM arrives, a watch that fails (``NEMO_RL_TEST_ONLY_FAIL_WATCH``), a stop that lands while a
recovery waits for its first re-dispatch (the final snapshot held open by the gate), and a snapshot a recovery
needs under ``checkpointing.keep_top_k=1``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from testkit.run_harness import new_marker, parent_pid, read_jsonl, replica_server_pids, run_env, run_once
from testkit.write_gate import gate_overrides
from tests.functional.rl_run import load_crash_matrix

pytestmark = [pytest.mark.functional, pytest.mark.timeout(420)]

cm = load_crash_matrix()
TWO_REPLICAS = "examples/configs/grpo_workplace_two_replicas_turn.yaml"
R0, R1 = "nemo_gym/replica-0", "nemo_gym/replica-1"


def committed(spec) -> list[dict]:
    return [r for r in read_jsonl(spec.logs / "snapshots.jsonl") if r.get("committed")]


def holds_rollouts_on(spec, replica: str) -> bool:
    """The newest committed snapshot saved turn-level rollouts on ``replica`` (a recovery has something to
    bring back from it)."""
    rows = committed(spec)
    if not rows:
        return False
    try:
        index = json.loads((Path(rows[-1]["path"]) / "gym_checkpoint.json").read_text())
    except OSError:
        return False
    return bool(index["turn_level"].get(replica))


def send(pids, sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def run(spec, kill_when, *, stop=None, env_extra: dict | None = None, timeout_s: float = 360):
    index = len(list(spec.root.glob("run-*.out"))) + 1 if spec.root.exists() else 1
    spec.root.mkdir(parents=True, exist_ok=True)
    return run_once(spec.args(), env=run_env(marker=new_marker(), extra=env_extra), kill_when=kill_when, stop=stop,
                    timeout_s=timeout_s, stdout_path=spec.root / f"run-{index}.out",
                    stderr_path=spec.root / f"run-{index}.err")


def stderr_of(outcome) -> str:
    return outcome.stderr_path.read_text(errors="replace")


def test_two_replicas_lost_at_the_same_moment_recover_side_by_side(tmp_path):
    """Both replicas' actors and servers SIGKILLed at once, after a snapshot saved rollouts on both: two
    recoveries, each replica replaced, and the second one's first re-dispatch does not wait for the first one's
    start (a serial recovery would put it after both starts)."""
    spec = cm.RunSpec(tmp_path / "run", config=TWO_REPLICAS, keep_latest_k=100, steps=3,
                      extra=["checkpointing.keep_top_k=100"])
    hit: list[int] = []

    def both_at_once(_elapsed: float) -> bool:
        if not hit and holds_rollouts_on(spec, R0) and holds_rollouts_on(spec, R1):
            servers = {r: replica_server_pids(spec.logs, r) for r in (R0, R1)}
            if all(servers.values()):
                pids = [parent_pid(next(iter(s.values()))) for s in servers.values()]  # each replica's actor
                pids += [p for s in servers.values() for p in s.values()]
                send(pids, signal.SIGKILL)
                hit.extend(pids)
        return False

    outcome = run(spec, both_at_once)
    assert hit, "no snapshot saved rollouts on both replicas before the run ended"
    err = stderr_of(outcome)
    assert outcome.returncode == 0, err[-5000:]
    assert cm.check_lineage(spec) == [] and not outcome.leftover
    rows = read_jsonl(spec.logs / "recoveries.jsonl")
    assert sorted(r["instance"] for r in rows) == [R0, R1], rows
    assert all(r["action"] == "replaced" and r["seconds_to_start"] and r["seconds_to_redispatch"] for r in rows), rows
    first, second = sorted(rows, key=lambda r: r["time"])
    timings = {r["instance"]: {k: r[k] for k in ("time", "seconds_to_start", "seconds_to_redispatch")} for r in rows}
    print("side by side:", json.dumps(timings))
    serial_at = first["time"] + first["seconds_to_start"] + second["seconds_to_start"]
    assert second["time"] + second["seconds_to_redispatch"] < serial_at, timings


def test_a_server_stopped_while_its_replica_persists_leaves_that_snapshot_and_is_recovered(tmp_path):
    """A staged snapshot's persist on replica-1 is held open (the gated writer) and replica-1's agent server is
    SIGSTOPped then: the snapshot lets replica-1 go within the park grace (its status probe finds the server
    silent) and commits replica-0's rollouts; the watch finds the server stopped after ``hung_after_s`` and the
    replica is replaced; no rollout on either replica waits for a 300 s call timeout."""
    gate = tmp_path / "gate"
    spec = cm.RunSpec(tmp_path / "run", config=TWO_REPLICAS, keep_latest_k=100, steps=3,
                      extra=["checkpointing.keep_top_k=100", "rollout_recovery.in_run.hung_after_s=4",
                             *gate_overrides(gate, "nemo_gym/replica-1/gym/agent/workplace_simple_agent")])
    stopped: list[int] = []

    def stop_while_persisting(_elapsed: float) -> bool:
        if not (gate / "armed").exists():
            if holds_rollouts_on(spec, R1):
                (gate / "armed").touch()  # the next persist of replica-1's agent is held at its first write
            return False
        if (gate / "reached").exists() and not stopped:
            pid = replica_server_pids(spec.logs, R1).get("workplace_simple_agent")
            if pid is not None:
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
                (gate / "release").touch()  # the stopped process cannot write anyway; later persists pass
        return False

    try:
        outcome = run(spec, stop_while_persisting)
    finally:
        send(stopped, signal.SIGCONT)
    assert stopped, "no persist of replica-1 reached the gate"
    err = stderr_of(outcome)
    assert outcome.returncode == 0, err[-5000:]
    assert cm.check_lineage(spec) == [] and not outcome.leftover
    snaps = read_jsonl(spec.logs / "snapshots.jsonl")
    left = [s for s in snaps if R1 in (s.get("left_out") or {}) and "workplace_simple_agent" in s["left_out"][R1]]
    assert left, [s.get("left_out") for s in snaps]
    assert all(s["persist_s"] < 30 for s in left), [(s["persist_s"], s["left_out"]) for s in left]
    assert any(s["committed"] for s in left), left  # replica-0's rollouts saved in it
    rows = read_jsonl(spec.logs / "recoveries.jsonl")
    assert rows and rows[0]["instance"] == R1 and rows[0]["cause"].startswith("stopped for "), rows
    assert max(m["step_s"] for m in read_jsonl(spec.logs / "metrics.jsonl")) < 120  # not the 300 s call timeout


def test_a_sigterm_while_a_replacement_start_hangs_takes_the_final_snapshot_and_the_relaunch_finishes(tmp_path):
    """A server of replica-1 is killed; every server its replacement starts is SIGSTOPped as it appears, so the
    start hangs (its deadline, ``timeout_s``, is longer than the test waits); SIGTERM then: the final snapshot of
    the other replica commits within the grace, the run exits 143 with nothing left running and the recovery's
    row written; the same command then finishes every group exactly once."""
    spec = cm.RunSpec(tmp_path / "run", config=TWO_REPLICAS, keep_latest_k=100, steps=3,
                      extra=["checkpointing.keep_top_k=100", "rollout_recovery.in_run.timeout_s=60"])
    killed: dict[str, int] = {}
    frozen: set[int] = set()

    def hang_the_replacement(_elapsed: float) -> bool:
        servers = replica_server_pids(spec.logs, R1)
        if not killed:
            if holds_rollouts_on(spec, R1) and "workplace_assistant" in servers:
                killed.update(servers)
                os.kill(servers["workplace_assistant"], signal.SIGKILL)
            return False
        new = {pid for pid in servers.values() if pid not in killed.values()}
        send(new - frozen, signal.SIGSTOP)
        frozen.update(new)
        return len(frozen) >= 2  # the new replica's servers are up and stopped: its start cannot finish

    def sigterm(proc: subprocess.Popen) -> str:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=90)
        return "sigterm"

    try:
        first = run(spec, hang_the_replacement, stop=sigterm)
    finally:
        send(frozen, signal.SIGCONT)
    err = stderr_of(first)
    assert first.killed_by == "sigterm" and first.returncode == 143, err[-5000:]
    assert not first.leftover
    final = [s for s in read_jsonl(spec.logs / "snapshots.jsonl") if s.get("requested") == "SIGTERM"]
    assert final and final[-1]["committed"], final
    assert R1 in final[-1].get("left_out", {}), final[-1]  # being recovered: it sat the snapshot out
    rows = read_jsonl(spec.logs / "recoveries.jsonl")
    assert len(rows) == 1 and rows[0]["instance"] == R1 and rows[0]["part"] == "workplace_assistant", rows
    second = cm.Runner(spec).run(timeout_s=360)
    assert second.returncode == 0, second.stderr[-5000:]
    assert cm.check_lineage(spec) == [] and not second.leftover


def test_a_watch_that_fails_is_reported_and_its_replica_replaced(tmp_path):
    """The first watch of replica-1 raises (an OSError, as a failed ``pidfd_open`` would): the replica is not
    left unwatched; it is replaced (its row names the failure) and watched again, and the run finishes."""
    spec = cm.RunSpec(tmp_path / "run", config=TWO_REPLICAS, keep_latest_k=100, steps=2,
                      extra=["checkpointing.keep_top_k=100"])
    outcome = run(spec, None, env_extra={"NEMO_RL_TEST_ONLY_FAIL_WATCH": R1})
    err = stderr_of(outcome)
    assert outcome.returncode == 0, err[-5000:]
    assert cm.check_lineage(spec) == [] and not outcome.leftover
    rows = read_jsonl(spec.logs / "recoveries.jsonl")
    assert len(rows) == 1, rows
    assert rows[0]["instance"] == R1 and rows[0]["part"] == "replica" and rows[0]["action"] == "replaced", rows
    assert rows[0]["cause"].startswith("its watch failed (OSError: TEST-ONLY"), rows
    assert f"the watch of {R1} failed" in err


def test_a_recovery_row_is_written_when_the_run_ends_while_it_waits_for_its_first_redispatch(tmp_path):
    """SIGTERM closes admission for good and the final snapshot's persist is held open (the gated writer on
    replica-0); meanwhile a server of replica-1 is killed and recovered: its rollouts are back but can never be
    dispatched again. Once the recovery says so, the gate opens, the final snapshot commits and the run ends:
    the row is written all the same, with no re-dispatch time."""
    gate = tmp_path / "gate"
    spec = cm.RunSpec(tmp_path / "run", config=TWO_REPLICAS, keep_latest_k=100, steps=4,
                      extra=["checkpointing.keep_top_k=100", "rollout_checkpointing.stop_grace_s=90",
                             *gate_overrides(gate, "nemo_gym/replica-0/gym/agent/workplace_simple_agent")])
    state: dict[str, object] = {}

    def stop_then_lose(proc: subprocess.Popen) -> str:
        (gate / "armed").touch()
        os.kill(proc.pid, signal.SIGTERM)  # admission closes for good; the final snapshot's persist meets the gate
        deadline = time.monotonic() + 120
        err_path = spec.root / "run-1.err"
        while time.monotonic() < deadline and proc.poll() is None:
            servers = replica_server_pids(spec.logs, R1)
            if "killed" not in state and (gate / "reached").exists() and "workplace_assistant" in servers:
                os.kill(servers["workplace_assistant"], signal.SIGKILL)
                state["killed"] = True
            if "killed" in state and f"Gym {R1} is back" in err_path.read_text(errors="replace"):
                (gate / "release").touch()
                break
            time.sleep(0.05)
        (gate / "release").touch()
        proc.wait(timeout=120)
        return "sigterm"

    outcome = run(spec, lambda _e: holds_rollouts_on(spec, R1), stop=stop_then_lose)
    err = stderr_of(outcome)
    assert state.get("killed"), err[-3000:]
    assert outcome.returncode == 143, err[-5000:]
    assert not outcome.leftover
    rows = read_jsonl(spec.logs / "recoveries.jsonl")
    assert len(rows) == 1 and rows[0]["instance"] == R1 and rows[0]["action"] == "restarted", rows
    assert rows[0]["seconds_to_redispatch"] is None, rows  # admission was closed: nothing went out again
    assert rows[0]["continued_turn"] or rows[0]["restarted_from_prompt"], rows


def test_the_snapshot_a_recovery_needs_survives_a_trainer_step_prune_at_keep_top_k_1(tmp_path):
    """Replica-1's control actor is stopped once a snapshot saved its rollouts, so later snapshots leave it
    out (its rollouts go on: the control actor is off their path, though a replica that left a snapshot gets
    new rollouts only when the other cannot take them); once a later trainer step is published and the older
    ones pruned at ``keep_top_k=1``, a server of replica-1 is killed. The snapshot that last saved replica-1
    (under the older anchor) is still on disk, named by the newer snapshots as carried, and is the one the
    recovery restores from."""
    spec = cm.RunSpec(tmp_path / "run", config=TWO_REPLICAS, keep_latest_k=100, steps=6,
                      extra=["checkpointing.keep_top_k=1", "rollout_recovery.gym_park_grace_s=1"])
    state: dict[str, object] = {}

    def control_actor(replica: str) -> int | None:
        """The pid of the replica's ``NemoGymControl`` actor, as ``gym_placement.json`` records it."""
        try:
            return json.loads((spec.logs / "gym_placement.json").read_text())[replica].get("control_pid")
        except (OSError, KeyError, ValueError):
            return None

    def tick(_elapsed: float) -> bool:
        if "held" not in state:
            rows = committed(spec)
            if rows and holds_rollouts_on(spec, R1):
                state["held"] = rows[-1]["path"]
                state["anchor"] = rows[-1]["anchor_step"]
                state["control"] = control_actor(R1)
                if state["control"] is not None:
                    os.kill(state["control"], signal.SIGSTOP)
            return False
        if "killed" in state or state.get("control") is None:
            return False
        newer = [r for r in committed(spec) if r["anchor_step"] > state["anchor"] and R1 in (r.get("left_out") or {})]
        if newer:  # a later trainer step was published (and the older ones pruned) and a snapshot left replica-1 out
            pid = replica_server_pids(spec.logs, R1).get("workplace_assistant")
            try:
                carried = json.loads((Path(newer[-1]["path"]) / "gym_checkpoint.json").read_text())["carried"]
            except OSError:
                return False  # pruned meanwhile: the next one
            if pid is not None:
                state["on_disk_at_kill"] = Path(state["held"]).is_dir()
                state["carried"] = carried
                os.kill(pid, signal.SIGKILL)
                state["killed"] = True
        return False

    try:
        outcome = run(spec, tick)
    finally:
        if state.get("control"):
            send([state["control"]], signal.SIGCONT)
    err = stderr_of(outcome)
    assert state.get("control") is not None, "replica-1's control actor was not found"
    assert state.get("killed"), err[-3000:]
    assert outcome.returncode == 0, err[-5000:]
    assert cm.check_lineage(spec) == [] and not outcome.leftover
    assert state["on_disk_at_kill"], state  # kept through the prune of its trainer step
    rows = read_jsonl(spec.logs / "recoveries.jsonl")
    recovered = [r for r in rows if r["instance"] == R1 and r["part"] == "workplace_assistant"]
    assert recovered and recovered[0]["snapshot"] == state["held"], (rows, state)
    assert recovered[0]["snapshot_age_s"] is not None and recovered[0]["snapshot_age_s"] > 0, recovered
    # the newest snapshot that left replica-1 out before the kill named the one that held its rollouts, for a relaunch
    assert spec.ckpt / state["carried"][R1] == Path(state["held"]), state
