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

from testkit.run_harness import parent_pid, read_jsonl, replica_server_pids
from tests.functional.rl_run import load_crash_matrix

pytestmark = [pytest.mark.functional, pytest.mark.timeout(420)]

cm = load_crash_matrix()
TWO_REPLICAS = "examples/configs/grpo_workplace_two_replicas_turn.yaml"
TWO_SHARDS = "examples/configs/grpo_mixed_two_shards_turn.yaml"
REPLICA = "nemo_gym/replica-1"


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
        self.turn_levels: dict[str, dict[str, list[str]]] = {}  # every committed snapshot's, read as it appears

    def turn_level(self, path: str) -> dict[str, list[str]]:
        """A committed snapshot's ``turn_level``, as read while the run ran (it may be pruned since)."""
        return self.turn_levels[path] if path in self.turn_levels else turn_level(path)

    def tick(self, _elapsed: float) -> bool:
        for row in read_jsonl(self.spec.logs / "snapshots.jsonl"):
            if row.get("committed") and row.get("path") and row["path"] not in self.turn_levels:
                try:
                    self.turn_levels[row["path"]] = turn_level(row["path"])
                except OSError:
                    self.turn_levels[row["path"]] = {}
        if len(self.sent) >= self.times:
            return False
        if not self.sent:  # the newest committed snapshot (the one a recovery restores from) holds some there
            committed = [s for s in read_jsonl(self.spec.logs / "snapshots.jsonl") if s.get("committed")]
            if not committed or not self.turn_levels.get(committed[-1].get("path"), {}).get(self.replica):
                return False
            self.snapshot = committed[-1]["path"]
        if len(read_jsonl(self.spec.logs / "recoveries.jsonl")) < len(self.sent):
            return False  # the last loss is not recovered yet
        pids = replica_server_pids(self.spec.logs, self.replica)
        if self.sent and set(pids.values()) & {p for _, hit in self.sent for p in hit.values()}:
            return False  # the last loss is not recovered yet
        if not pids or (self.target != "replica" and self.target not in pids):
            return False
        if self.target == "replica":  # the actor first: a server dying before it would be a server's loss
            hit = {"actor": parent_pid(next(iter(pids.values()))), **pids}
        else:
            hit = {self.target: pids[self.target]}
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


def run_with_fault(tmp_path: Path, fault_args: dict, *, config: str = TWO_REPLICAS, extra: list[str] = (),
                   keep_latest_k: int = 100, **spec_kw):
    # Every snapshot is kept unless asked, so the one a recovery restored from can be read afterwards.
    spec = cm.RunSpec(tmp_path / "run", config=config, keep_latest_k=keep_latest_k,
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
    held = set(fault.turn_level(first["snapshot"]).get(fault.replica, []))
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
    from nemo_rl.cli.inspect import inspect, render

    args = spec.args()
    report = inspect(str(spec.ckpt), args[1], args[2:])  # the inspector shows the last recoveries
    assert report["recoveries"] == rows
    assert f"in-run recovery: {REPLICA} {server} " in render(report)


def test_a_killed_replica_actor_is_replaced_and_its_rollouts_continue(tmp_path):
    spec, fault, result = run_with_fault(tmp_path, dict(target="replica"))
    rows = check_recovery_rows(spec, fault, result, part="replica", action="replaced")
    assert "Ray actor died" in rows[0]["cause"], rows[0]
    placement = json.loads((spec.logs / "gym_placement.json").read_text())
    assert set(placement) == {"nemo_gym/replica-0", REPLICA}  # where the new replica runs, written again


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
            if saving.sent and replica_server_pids(spec.logs, "mixed/replica-1"):
                mixed.snapshot = saving.snapshot
                mixed.sent.append((time.time(), {"python_sandbox": replica_server_pids(spec.logs, "mixed/replica-1")
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
    """keep_latest_k=1: the snapshots taken while the server is stopped leave its replica out, and the one
    that saved its rollouts is kept past the limit until the recovery has restored from it."""
    spec, fault, result = run_with_fault(
        tmp_path, dict(target="workplace_assistant", sig=signal.SIGSTOP), keep_latest_k=1,
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
    assert not replica_server_pids(spec.logs, REPLICA), "the given-up replica's servers still run"
    assert set(json.loads((spec.logs / "gym_placement.json").read_text())) == {"nemo_gym/replica-0"}


def test_a_crash_loop_on_the_only_replica_stops_the_run_naming_the_server_and_its_log(tmp_path):
    spec, fault, result = run_with_fault(
        tmp_path, dict(target="workplace_assistant", replica="nemo_gym/replica-0", times=3), steps=6,
        config="examples/configs/grpo_workplace_turn.yaml",
        # the default max_consecutive_failures (3): snapshots whose prepare meets the killed server fail, and are
        # not failures in a row (the recovery owns them), so the run stops on the crash-loop bound
        extra=["rollout_recovery.in_run.max_recoveries=2"])
    assert len(fault.sent) == 3, (fault.sent, result.stderr[-3000:])
    assert result.returncode == 1, result.stderr[-5000:]
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, result.stderr[-5000:]
    assert "'workplace_assistant' of nemo_gym/replica-0" in errors[0] and "max_recoveries=2" in errors[0], errors
    log = spec.logs / "gym-instances" / "nemo_gym" / "replica-0" / "workplace_assistant.log"
    assert str(log) in errors[0] or str(log.resolve()) in errors[0], errors
    assert "Traceback" not in result.stderr
    assert not result.leftover
    rows = read_jsonl(spec.logs / "recoveries.jsonl")  # the loss that stopped the run has its row too
    assert [r["action"] for r in rows] == ["restarted", "restarted", "given_up"], rows
    assert "max_recoveries=2" in rows[-1]["given_up"], rows[-1]


class StopThenKill(Fault):
    """SIGSTOPs the server as ``Fault`` does; once ``failures`` snapshots in a row have failed since, SIGKILLs it
    (a gate: the failures under test happen while it is stopped, however slow or fast the machine)."""

    def __init__(self, spec, failures: int, **kw):
        super().__init__(spec, sig=signal.SIGSTOP, **kw)
        self.failures = failures
        self.rows_at_stop: int | None = None
        self.killed_after: int | None = None  # the failed attempts in a row seen when it was killed

    def failed_in_a_row(self) -> int:
        """Failed attempts since the stop and since the last one that committed (one under way at the stop may)."""
        rows = [r for r in read_jsonl(self.spec.logs / "snapshots.jsonl")[self.rows_at_stop:]
                if r["reason"] != "superseded"]
        committed = [i for i, r in enumerate(rows) if r["committed"]]
        return len(rows) - (committed[-1] + 1 if committed else 0)

    def tick(self, elapsed: float) -> bool:
        if not self.sent:
            rows = len(read_jsonl(self.spec.logs / "snapshots.jsonl"))
            super().tick(elapsed)
            if self.sent:
                self.rows_at_stop = rows
        elif self.killed_after is None and self.failed_in_a_row() >= self.failures:
            self.killed_after = self.failed_in_a_row()
            for pid in self.sent[0][1].values():
                os.kill(pid, signal.SIGKILL)
        return False


def test_snapshots_failing_on_a_stopped_server_of_the_only_replica_do_not_stop_the_run(tmp_path):
    """One replica: while its server is stopped every snapshot fails (nothing else to take), and the watch would
    report it only after ``hung_after_s`` (300 s here). Those failures are the recovery's, not failures in a row:
    three of them at ``max_consecutive_failures=2`` leave the run going; then the server is killed, the watch
    sees the exit at once, and it is recovered."""
    spec = cm.RunSpec(tmp_path / "run", config="examples/configs/grpo_workplace_turn.yaml", keep_latest_k=100,
                      steps=4, extra=["checkpointing.keep_top_k=100", "rollout_recovery.in_run.hung_after_s=300",
                                      "rollout_checkpointing.max_consecutive_failures=2"])
    fault = StopThenKill(spec, failures=3, target="workplace_assistant", replica="nemo_gym/replica-0")
    try:
        result = cm.Runner(spec).run(kill_when=fault.tick, timeout_s=360)
    finally:
        fault.release()
    assert fault.killed_after is not None, ("the stop never met three failed snapshots in a row", fault.sent,
                                            result.stderr[-3000:])
    rows = check_recovery_rows(spec, fault, result, part="workplace_assistant", action="restarted")
    assert rows[0]["cause"].startswith("died (exit -9"), rows[0]
    failed = [r for r in read_jsonl(spec.logs / "snapshots.jsonl")[fault.rows_at_stop:] if not r["committed"]]
    assert len(failed) >= 3 and all(r["reason"] in ("gym_unavailable", "superseded") for r in failed), failed
    assert any("'workplace_assistant'" in r.get("error", "") for r in failed), failed  # the stopped server named


def test_async_lookahead_one_a_killed_server_is_recovered(tmp_path):
    spec, fault, result = run_with_fault(tmp_path, dict(target="workplace_assistant"), lookahead=1, shuffle=False)
    check_recovery_rows(spec, fault, result, part="workplace_assistant", action="restarted")


@pytest.mark.alone  # CPU-bound (the torch worker decodes): shares no core under xdist
def test_prefix_level_the_cuts_of_a_restarted_replica_continue_from_their_tokens(tmp_path):
    """``target_level: prefix`` with a Llama from a directory on the torch worker (the decode hold keeps calls
    in flight across snapshots): once the newest committed snapshot holds generation cuts on saving/replica-1,
    its model server is SIGKILLed. The recovery installs the cuts on the restarted replica and each continues
    from its tokens (same call id and token count), in the same run. A cut whose call had ended before the
    loss (its rollout sealed) is not continued; then the next snapshot with cuts is waited for and the server
    killed again, up to three times, until a recovery has continued a cut. Five steps, kills in the first
    three: a run of two held no snapshot with a cut on the replica, in CI."""
    from tests.functional.rl_run import RunDirs
    from tests.functional.test_prefix_recovery import PROMPTS, _args, assert_held, held_env
    from tests.model_fixtures import llama_dir
    from testkit.run_harness import run_once

    dirs = RunDirs(tmp_path / "run")
    model = llama_dir(tmp_path / "my-llama")
    replica = "saving/replica-1"
    kills: list[str] = []  # the snapshot each kill followed
    indexes: dict[str, dict] = {}  # its gym_checkpoint.json, read then (a bootstrap snapshot goes with step 1)
    steps, kills_before_step = 5, 3

    def kill_after_cuts(_elapsed: float) -> bool:
        rows = read_jsonl(dirs.logs / "recoveries.jsonl")
        if len(rows) < len(kills) or len(kills) >= 3 or any(r["continued_prefix"] for r in rows):
            return False  # a recovery under way, enough kills, or a cut continued already
        if len(read_jsonl(dirs.logs / "metrics.jsonl")) >= kills_before_step:
            return False  # a loss in the last step's tail may not be seen before the run ends
        committed = [r for r in read_jsonl(dirs.logs / "snapshots.jsonl") if r.get("committed")]
        if not committed or not committed[-1].get("cuts") or committed[-1]["path"] in kills:
            return False  # the newest (what a recovery restores from) must hold cuts, a new one each time
        try:
            index = json.loads((Path(committed[-1]["path"]) / "gym_checkpoint.json").read_text())
        except FileNotFoundError:
            return False  # pruned meanwhile: a newer one is committed
        pid = replica_server_pids(dirs.logs, replica).get("policy_model")
        if index.get("cut_tokens", {}).get(replica) and pid is not None:
            os.kill(pid, signal.SIGKILL)
            kills.append(committed[-1]["path"])
            indexes[committed[-1]["path"]] = index
        return False

    outcome = run_once(_args(dirs, model) + [f"grpo.max_num_steps={steps}"], env=held_env(),
                       kill_when=kill_after_cuts, timeout_s=600,
                       stdout_path=tmp_path / "out.txt", stderr_path=tmp_path / "err.txt")
    stderr = (tmp_path / "err.txt").read_text(errors="replace")
    assert_held(dirs.logs)
    assert kills, "no committed snapshot held a generation cut on the replica"
    assert outcome.returncode == 0, stderr[-5000:]
    assert not (dirs.logs / "restore.json").exists()  # no relaunch
    rows = read_jsonl(dirs.logs / "recoveries.jsonl")
    assert len(rows) == len(kills) and all(r["part"] == "policy_model" and r["action"] == "restarted"
                                           for r in rows), rows
    with_cuts = [r for r in rows if r["continued_prefix"]]
    assert with_cuts, rows
    metrics = read_jsonl(dirs.logs / "metrics.jsonl")
    continued = {c["rollout_id"]: c for r in metrics for c in r.get("prefix_continuations", [])}
    for row in with_cuts:
        index = indexes.get(row["snapshot"])
        if index is None:
            index = json.loads((Path(row["snapshot"]) / "gym_checkpoint.json").read_text())
        cut_tokens = index["cut_tokens"].get(replica, {})
        assert set(row["continued_prefix"]) <= set(cut_tokens), row
        for key in row["continued_prefix"]:
            base, _, attempt = key.rpartition("-a") if "-a" in key else (key, "", "0")
            use = continued.get(f"{base}-a{int(attempt) + 1}")
            assert use is not None, (key, sorted(continued))
            assert use["token_count"] == cut_tokens[key] and use["discarded"] is None, use
    groups = [g for r in metrics for g in r["groups"]]
    assert len(groups) == len(set(groups)) == steps * PROMPTS
    assert not outcome.leftover


def test_a_sigkill_of_the_whole_run_during_a_recovery_then_the_same_command_loses_nothing_saved(tmp_path):
    """The run is SIGKILLed while a recovery of replica-1 is under way (its stderr says it began, not that it
    ended); the same command restores from the newest snapshot, which holds replica-1's rollouts or, when it
    left replica-1 out (snapshots go on during a recovery), carries the older snapshot that does: every group
    trained once, none of the saved rollouts restarted from its prompt."""
    spec = cm.RunSpec(tmp_path / "run", config=TWO_REPLICAS, keep_latest_k=100, steps=3,
                      extra=["checkpointing.keep_top_k=100"])
    fault = Fault(spec, "workplace_assistant")
    runner = cm.Runner(spec)

    def kill_mid_recovery(elapsed: float) -> bool:
        fault.tick(elapsed)
        if not fault.sent:
            return False
        err = (spec.root / f"run-{runner.count}.err").read_text(errors="replace")
        return f"Gym {REPLICA} lost workplace_assistant" in err and f"recovered {REPLICA}" not in err

    first = runner.run(kill_when=kill_mid_recovery, timeout_s=360)
    assert first.killed_by == "group", first.stderr[-3000:]
    assert not first.leftover
    snaps = [s for s in read_jsonl(spec.logs / "snapshots.jsonl") if s.get("committed")]
    newest = snaps[-1]["path"]
    carried = json.loads((Path(newest) / "gym_checkpoint.json").read_text()).get("carried", {})
    holder = spec.ckpt / carried[REPLICA] if REPLICA in carried else Path(newest)
    assert REPLICA in turn_level(newest) or REPLICA in carried, newest  # it took part, or names who holds it
    held = set(turn_level(holder).get(REPLICA, []))
    assert held, (newest, carried)
    second = runner.run(timeout_s=360)
    assert second.returncode == 0, second.stderr[-5000:]
    assert cm.check_lineage(spec) == []
    restore = second.restore
    assert restore is not None and restore["snapshot"] == newest, restore
    continued = {k.rsplit("-a", 1)[0] for k in restore["restored_rollout_ids"]}
    trained = cm.trained_rollout_ids(spec)
    for key in held:  # each saved rollout continued at its next attempt, or had sealed before the snapshot
        assert key.rsplit("-a", 1)[0] in continued or key in trained, key
