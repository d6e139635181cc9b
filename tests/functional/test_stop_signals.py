"""A run told to stop by a scheduler (docs/design.md §5.11), on real runs with real processes.

Each case starts a run (scripted replies, snapshots every 30 s so that only a
signal takes one), signals it while rollouts are in flight, then runs the same
command to the end:

- ``launcher``: one replica, sync, started by ``examples/slurm/grpo.sbatch``
  under bash: SIGUSR1 (a ``requested`` snapshot row, the run goes on), then
  SIGTERM, both to the batch shell alone as Slurm's ``--signal=B:`` sends them;
- ``every_process``: two shards x two replicas with restart-only servers
  (``allow_restart_only_gym_servers=true``), async: SIGTERM to every process of
  the run at once, as Slurm's preemption sends it;
- ``during_training``: one replica, async: the run SIGTERMs itself while step 2
  trains (the step then writes its checkpoint), and again while the final
  snapshot is written: the second exits at once;
- ``ctrl_c``: one replica started with SIGINT ignored (a background job), a
  Ctrl-C to its process group: no traceback;
- ``agent_stopped``: one replica, sync, its agent server SIGSTOPped just before
  the SIGTERM and resumed 4 s later: the final snapshot's first attempts fail
  (the agent does not answer), and one within the grace commits.

Every stop must exit with 128 + the signal number and one ``stopped by`` line,
leave no process behind, publish nothing torn, and the relaunch must restore
the final snapshot (each rollout it saved at its last turn continues there) and
train every prompt group exactly once.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from testkit.run_harness import REPO, grpo_command, gym_server_pid, new_marker, processes_with_marker, reap, run_env
from tests.functional.rl_run import load_crash_matrix

pytestmark = [pytest.mark.functional, pytest.mark.timeout(600)]

cm = load_crash_matrix()
WORKPLACE = "examples/configs/grpo_workplace_turn.yaml"
GRACE_S = 25.0  # rollout_checkpointing.stop_grace_s's default
SIGNAL_ENV = "NEMO_RL_TEST_ONLY_SIGNAL_AT"
SBATCH = REPO / "examples" / "slurm" / "grpo.sbatch"  # the batch script forwards its signals to the run
SLOW_VALIDATION_S = GRACE_S + 5  # a validation longer than the grace
AGENT_STOPPED_S = 4.0  # how long ``agent_stopped`` holds the agent server stopped after the SIGTERM


@dataclass
class Stopped:
    spec: Any
    returncode: int | None
    output: str
    exit_s: float  # from the (first) signal to the driver's exit
    signalled_at: float  # time.time() of the (first) signal
    leftover: list[int]
    rows: list[dict[str, Any]]  # snapshots.jsonl of the stopped run
    metrics: list[dict[str, Any]]  # metrics.jsonl of the stopped run
    published: dict[str, dict[str, bytes]]  # each snapshot on disk when the stopped run ended: its files
    final: Any = None  # the relaunch (cm.RunResult)
    notes: list[str] = field(default_factory=list)

    def final_rows(self, by: str) -> list[dict[str, Any]]:
        return [r for r in self.rows if r.get("requested") == by]


def _start(spec, *, env: dict[str, str], out: Path, ignore_sigint: bool = False,
           via_sbatch: bool = False) -> subprocess.Popen:
    def preexec() -> None:
        if ignore_sigint:  # as a background job of a non-interactive shell starts
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    command = ["bash", str(SBATCH), *spec.args()] if via_sbatch else grpo_command(spec.args())
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=out.open("wb"),
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=preexec)


def _wait_for(proc: subprocess.Popen, check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _in_flight_with_turns(spec) -> bool:
    """Rollouts generating past their first turn: the step's first row is written and a moment passed."""
    return bool(spec.records("metrics.jsonl"))


def _slow_validation(root: Path) -> list[str]:
    """Validation data: five rows, the first one's first model reply ``SLOW_VALIDATION_S`` late (longer
    than the grace; the scripted backend's ``scripted_first_reply_delay_s``); the overrides that
    validate every second step on it."""
    rows = [json.loads(line) for line in (REPO / "examples/data/mixed_val.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["task_source"] != "python_sandbox"][:5]
    rows[0]["scripted_first_reply_delay_s"] = SLOW_VALIDATION_S
    data = root / "slow_val.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [f"data.val_data_path={data}", "grpo.val_period=2", "grpo.max_val_samples=5"]


def _stop_case(root: Path, *, config: str, lookahead: int, deliver: str, signal_at: str | None = None,
               usr1_first: bool = False, ignore_sigint: bool = False, via_sbatch: bool = False,
               slow_validation: bool = False, delay_s: float = 0.6) -> Stopped:
    root.mkdir(parents=True, exist_ok=True)
    spec = cm.RunSpec(root, config=config, steps=3, interval_s=30.0, delay_s=delay_s, lookahead=lookahead,
                      shuffle=lookahead == 0, extra=_slow_validation(root) if slow_validation else [])
    marker = new_marker()
    extra = {SIGNAL_ENV: signal_at} if signal_at else {}
    env = run_env(marker=marker, extra=extra)
    out = root / "stopped.out"
    proc = _start(spec, env=env, out=out, ignore_sigint=ignore_sigint, via_sbatch=via_sbatch)
    notes: list[str] = []
    try:
        if signal_at is None:
            _wait_for(proc, lambda: _in_flight_with_turns(spec), 300, "step 1's metrics row")
            time.sleep(1.5)  # step 2's rollouts are past their first reply
            if usr1_first:
                os.kill(proc.pid, signal.SIGUSR1)
                _wait_for(proc, lambda: any(r.get("requested") == "SIGUSR1" for r in spec.records("snapshots.jsonl")),
                          60, "the SIGUSR1 snapshot row")
                notes.append(f"metrics rows at SIGUSR1: {len(spec.records('metrics.jsonl'))}")
                time.sleep(1.0)
            signalled_at = time.time()
            t0 = time.monotonic()
            if deliver == "launcher":
                os.kill(proc.pid, signal.SIGTERM)
            elif deliver == "agent_stopped":
                agent = gym_server_pid(marker, "workplace_simple_agent")
                assert agent is not None, "no agent server process found"
                os.kill(agent, signal.SIGSTOP)
                try:
                    os.kill(proc.pid, signal.SIGTERM)
                    time.sleep(AGENT_STOPPED_S)
                finally:
                    with contextlib.suppress(ProcessLookupError):  # the run may be gone already
                        os.kill(agent, signal.SIGCONT)
            elif deliver == "every_process":
                for pid in {proc.pid, *processes_with_marker(marker)}:
                    try:
                        os.kill(pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
                try:
                    os.killpg(proc.pid, signal.SIGTERM)  # Ray's agents carry no marker but are in the group
                except ProcessLookupError:
                    pass
            elif deliver == "ctrl_c":
                os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends to its foreground group
            else:
                raise ValueError(deliver)
        else:
            signalled_at, t0 = time.time(), time.monotonic()  # refined from the output below
        proc.wait(timeout=GRACE_S + 60)
        exit_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    leftover = reap(marker, 30)
    return Stopped(spec, proc.returncode, out.read_text(errors="replace"), exit_s, signalled_at, leftover,
                   spec.records("snapshots.jsonl"), spec.records("metrics.jsonl"), _published(spec), notes=notes)


def _published(spec) -> dict[str, dict[str, bytes]]:
    """The files of every snapshot a row says was published and that is still on disk (a relaunch prunes)."""
    out = {}
    for row in spec.records("snapshots.jsonl"):
        path = Path(row["path"]) if row.get("committed") and row.get("path") else None
        if path is not None and path.is_dir():
            out[row["path"]] = {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}
    return out


CASES = {
    # Slurm's --signal=B:TERM: the batch shell alone gets the signals and forwards them to the run
    "launcher": dict(config=WORKPLACE, lookahead=0, deliver="launcher", usr1_first=True, via_sbatch=True),
    "every_process": dict(config=cm.TWO_SHARDS_CONFIG, lookahead=1, deliver="every_process"),
    "during_training": dict(config=cm.MIXED_CONFIG, lookahead=1, deliver="hook", signal_at="train:2,persist"),
    "ctrl_c": dict(config=WORKPLACE, lookahead=0, deliver="ctrl_c", ignore_sigint=True),
    # replies slower than the agent is held stopped: rollouts are still in flight when it answers again
    "agent_stopped": dict(config=WORKPLACE, lookahead=0, deliver="agent_stopped", delay_s=AGENT_STOPPED_S + 2),
    # async: step 3's groups generate while step 2 validates; the stop lands when a quick validation
    # rollout has finished and the slow one (longer than the grace) still runs
    "during_validation": dict(config=cm.MIXED_CONFIG, lookahead=1, deliver="hook", signal_at="validate",
                              slow_validation=True),
}


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """``stopped(name)``: that case's stopped run and its relaunch, made once on first use."""
    done: dict[str, Stopped | str] = {}

    def get(name: str) -> Stopped:
        if name not in done:
            root = tmp_path_factory.mktemp(name)
            case = _stop_case(root, **CASES[name])
            if name not in ("ctrl_c", "agent_stopped"):  # their final snapshot is the same path as SIGTERM's: no second relaunch
                runner = cm.Runner(case.spec, log=lambda _: None)
                runner.count = 1  # the stopped run was the first
                case.final = runner.run(timeout_s=300)
            done[name] = case
        case = done[name]
        if isinstance(case, str):
            pytest.fail(case)
        return case

    return get


def _check_relaunch(case: Stopped, final_row: dict[str, Any]) -> None:
    assert case.final.returncode == 0, case.final.stderr[-3000:]
    r = case.final.restore
    assert r is not None, "the relaunch wrote no restore.json"
    assert r["snapshot"] == final_row["path"], (r["snapshot"], final_row)
    # every rollout the final snapshot saved at its last turn continues there, at the next attempt
    assert r["restored_turn"] == final_row["saved"] == len(r["restored_rollout_ids"]), (r, final_row)
    assert all(i.endswith("-a1") for i in r["restored_rollout_ids"]), r["restored_rollout_ids"]
    assert cm.check_lineage(case.spec) == []
    assert cm.check_restore(r, cm.trained_rollout_ids(case.spec), final=True) == []
    assert case.final.leftover == []


def _stop_line(case: Stopped, by: str) -> str:
    lines = [line for line in case.output.splitlines() if line.startswith(f"stopped by {by}")]
    assert len(lines) == 1, case.output[-3000:]
    return lines[0]


def test_sigusr1_takes_a_requested_snapshot_and_the_run_goes_on(stopped):
    case = stopped("launcher")
    rows = case.final_rows("SIGUSR1")
    assert len(rows) == 1 and rows[0]["committed"], case.rows
    later = [r for r in case.rows if r is not rows[0]]
    assert later and later[-1]["requested"] == "SIGTERM", "the run went on after SIGUSR1 until SIGTERM"


@pytest.mark.parametrize("name", ["launcher", "every_process"])
def test_sigterm_takes_a_final_snapshot_and_the_relaunch_continues_it(stopped, name):
    case = stopped(name)
    assert case.returncode == 143, case.output[-3000:]
    assert case.exit_s < GRACE_S, case.exit_s
    assert case.leftover == []
    final = case.final_rows("SIGTERM")
    assert len(final) == 1 and final[0]["committed"], (case.rows, case.output[-3000:])
    assert final[0]["saved"] > 0, final[0]  # rollouts in flight were saved at their last turn
    line = _stop_line(case, "SIGTERM")
    assert Path(final[0]["path"]).name in line and "run the same command to continue" in line, line
    assert "Traceback" not in case.output, case.output[-3000:]
    if name == "every_process":
        assert final[0]["unsaved"] > 0, final[0]  # the restart-only shard's rollouts restart from the prompt
    _check_relaunch(case, final[0])


def test_a_stop_while_a_step_trains_and_a_second_sigterm_tear_nothing(stopped):
    case = stopped("during_training")
    assert case.returncode == 143, case.output[-3000:]
    assert "TEST-ONLY signal" in case.output and "a second SIGTERM" in _stop_line(case, "SIGTERM")
    assert case.leftover == []
    # nothing torn: every published trainer step and snapshot verifies, so the relaunch takes the newest
    assert case.final.returncode == 0, case.final.stderr[-3000:]
    r = case.final.restore
    assert r is not None and r["skipped_trainer_steps"] == [] and r["skipped_snapshots"] == [], r
    assert cm.check_lineage(case.spec) == []


def test_ctrl_c_in_a_background_job_stops_without_a_traceback(stopped):
    case = stopped("ctrl_c")
    assert case.returncode == 130, case.output[-3000:]
    line = _stop_line(case, "SIGINT")
    assert "run the same command to continue" in line
    assert "Traceback" not in case.output and "KeyboardInterrupt" not in case.output, case.output[-3000:]
    assert case.leftover == []
    final = case.final_rows("SIGINT")
    assert len(final) == 1 and final[0]["committed"] and final[0]["saved"] > 0, case.rows


def test_a_stop_during_validation_snapshots_at_once_and_saves_no_validation_rollout(stopped):
    # Validation used to hold snapshots off until it ended: the final snapshot then waited past its
    # budget for the slow validation rollout, and the stop published none.
    case = stopped("during_validation")
    assert case.returncode == 143, case.output[-3000:]
    assert "TEST-ONLY signal" in case.output and case.leftover == []
    final = case.final_rows("SIGTERM")
    assert len(final) == 1 and final[0]["committed"], (case.rows, case.output[-3000:])
    assert final[0]["step"] == 2 and final[0]["anchor_step"] == 1, final[0]  # cut while step 2 validated
    assert not [m for m in case.metrics if "val_reward_mean" in m], case.output[-3000:]  # it never finished
    # validation rollouts are in no commit scope and no unsaved list: nothing of theirs is in the snapshot
    files = case.published[final[0]["path"]]
    assert files and not [name for name, data in files.items() if b"val_s" in data], sorted(files)
    _check_relaunch(case, final[0])
    validated = [m["step"] for m in case.spec.records("metrics.jsonl") if "val_reward_mean" in m]
    assert validated == [2], validated  # the relaunch validates step 2 again


def test_a_failed_final_snapshot_is_tried_again_within_the_grace(stopped):
    # One attempt used to be all: a replica too busy (here: stopped) to answer its probe in time
    # meant no final snapshot, with most of the grace unused.
    case = stopped("agent_stopped")
    assert case.returncode == 143, case.output[-3000:]
    assert case.exit_s < GRACE_S and case.leftover == [], (case.exit_s, case.leftover)
    final = case.final_rows("SIGTERM")
    assert len(final) >= 2, final
    assert not any(r["committed"] for r in final[:-1]) and final[0]["reason"] == "gym_unavailable", final
    assert final[-1]["committed"] and final[-1]["saved"] > 0, final[-1]
    line = _stop_line(case, "SIGTERM")
    assert Path(final[-1]["path"]).name in line, line
