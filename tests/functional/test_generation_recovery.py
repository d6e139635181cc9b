"""In-run recovery of the generation worker (docs/design.md §5.12), end to end: real ``run_grpo`` processes, a
Llama from a directory on the torch worker (a model the code did not create), 2 shards x 2 Gym replicas (four
model servers sending calls to one worker), real Ray actors.

The worker is SIGKILLed (or SIGSTOPped) while model calls are in flight, right after a committed snapshot.
The run must go on by itself: exit 0, no relaunch, no rollout sent back to its prompt, every prompt group
trained once, the refit check of every step after the restart within its bound, and one ``recoveries.jsonl``
row with ``part: generation`` that counts the calls sent again. At ``prefix`` level the calls continue from
the cut the snapshot fetched of themselves: same call id, its tokens kept.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import ray

from testkit.run_harness import generation_worker_pid, read_jsonl, run_once
from tests.functional.rl_run import RunDirs

pytestmark = [pytest.mark.functional, pytest.mark.timeout(600)]

TWO_SHARDS = "examples/configs/grpo_mixed_two_shards_turn.yaml"
STEPS, PROMPTS, GENERATIONS = 3, 4, 2
REFIT_CHECK = 1e-3  # gen_logprob_abs_err of every step: the new worker serves the trainer's weights


def _args(dirs: RunDirs, model: Path, level: str, *, lookahead: int = 0, extra: tuple[str, ...] = ()) -> list[str]:
    async_keys = [f"async_rl.sampler.max_lookahead_versions={lookahead}", "grpo.use_generation_logprobs=true",
                  "async_rl.min_groups_for_streaming_train=2"] if lookahead else []
    return [
        "--config", TWO_SHARDS, *dirs.overrides(), f"policy.model_name={model}", "logger.plot=false",
        f"rollout_recovery.target_level={level}", "rollout_recovery.allow_restart_only_gym_servers=true",
        "policy.generation.ignore_eos=true", "rollout_recovery.in_run.hung_after_s=5",
        f"grpo.max_num_steps={STEPS}", f"grpo.num_prompts_per_step={PROMPTS}",
        f"grpo.num_generations_per_prompt={GENERATIONS}", "grpo.val_period=0", "grpo.val_at_start=false",
        "rollout_checkpointing.snapshot_attempt_interval_s=0.2", "rollout_checkpointing.keep_latest_k=50",
        *async_keys, *extra,
    ]


class WorkerFault:
    """Sends ``sig`` to the generation worker once a committed snapshot (with a generation cut, at
    ``prefix``) is the newest, up to ``times`` times, each once the last loss has its row, and only while
    fewer than ``kills_before_step`` steps are trained (a death after the last rollout ended needs no
    recovery: the run may end before it is seen). With ``until_kill`` (the decode hold's marker: a worker
    holds a batch whose calls a cut pinned until it is killed), only once the hold is in place and a
    snapshot committed since holds cuts: those cuts' calls are still decoding at the kill."""

    def __init__(self, dirs: RunDirs, sig: int = signal.SIGKILL, *, cuts: bool = False, times: int = 1,
                 wait_row: bool = True, kills_before_step: int | None = None, until_kill: Path | None = None):
        self.dirs, self.sig, self.cuts, self.times, self.wait_row = dirs, sig, cuts, times, wait_row
        self.kills_before_step = kills_before_step
        self.until_kill = until_kill
        self.held_after: int | None = None  # committed snapshots when the hold began
        self.sent: list[int] = []
        self.after: set[str] = set()  # the snapshots a kill followed

    def tick(self, _elapsed: float) -> bool:
        if len(self.sent) >= self.times:
            return False
        if self.until_kill is not None:
            committed = [r for r in read_jsonl(self.dirs.logs / "snapshots.jsonl") if r.get("committed")]
            if not self.until_kill.exists():
                return False
            if self.held_after is None:
                self.held_after = len(committed)
                return False
            if not any(r.get("cuts") for r in committed[self.held_after:]):
                return False
        rows = read_jsonl(self.dirs.logs / "recoveries.jsonl")
        if self.wait_row and len(rows) < len(self.sent):
            return False
        if self.cuts and any(r["calls_continued_from_cut"] for r in rows):
            return False  # a recovery continued a cut: enough
        if (self.kills_before_step is not None
                and len(read_jsonl(self.dirs.logs / "metrics.jsonl")) >= self.kills_before_step):
            return False
        committed = [r for r in read_jsonl(self.dirs.logs / "snapshots.jsonl") if r.get("committed")]
        if not committed or (self.cuts and not committed[-1].get("cuts")) or committed[-1]["path"] in self.after:
            return False  # a newer snapshot each time
        pid = generation_worker_pid(self.dirs.logs)
        if pid is None or pid in self.sent:
            return False
        os.kill(pid, self.sig)
        self.sent.append(pid)
        self.after.add(committed[-1]["path"])
        return False

    def release(self) -> None:
        for pid in self.sent if self.sig == signal.SIGSTOP else []:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def run_with_worker_fault(tmp_path: Path, level: str, fault_kw: dict, *, env: dict | None = None,
                          **args_kw) -> tuple[RunDirs, WorkerFault, object, str]:
    from tests.functional.test_prefix_recovery import assert_held, hold_env_kw
    from tests.model_fixtures import llama_dir
    from testkit.run_harness import run_env

    dirs = RunDirs(tmp_path / "run")
    model = llama_dir(tmp_path / "my-llama")
    fault = WorkerFault(dirs, **fault_kw)
    if level == "prefix" and env is None:
        held = hold_env_kw()
        if fault.until_kill is not None:
            held["extra"] = {**held["extra"], "NEMO_RL_TEST_ONLY_DECODE_HOLD_UNTIL_KILL": str(fault.until_kill)}
        env = run_env(**held)
    try:
        outcome = run_once(_args(dirs, model, level, **args_kw),
                           env=env or run_env(),
                           kill_when=fault.tick, timeout_s=540, stdout_path=tmp_path / "out.txt",
                           stderr_path=tmp_path / "err.txt")
    finally:
        fault.release()
    if level == "prefix" and env is None:
        assert_held(dirs.logs)
    return dirs, fault, outcome, (tmp_path / "err.txt").read_text(errors="replace")


def check_generation_recovered(dirs: RunDirs, fault: WorkerFault, outcome, stderr: str, *, steps: int = STEPS,
                               prompts: int = PROMPTS) -> list[dict]:
    """The run went on by itself, nothing went back to its prompt, and the row counts the calls sent again."""
    assert fault.sent, "no committed snapshot before the run ended"
    assert outcome.returncode == 0, stderr[-5000:]
    assert not (dirs.logs / "restore.json").exists()  # no relaunch
    assert not outcome.leftover
    assert "retrying from the prompt" not in stderr, [ln for ln in stderr.splitlines() if "retrying" in ln][:3]
    rows = read_jsonl(dirs.logs / "recoveries.jsonl")
    assert len(rows) == len(fault.sent), rows
    for row in rows:
        assert row["part"] == "generation" and row["action"] == "restarted" and row["instance"] == "generation", row
        assert row["restarted_from_prompt"] == [], row
        assert row["calls_resent"] > 0 and row["seconds_to_redispatch"] is not None, row
        assert row["log"] and Path(row["log"]).is_file(), row
    lines = [ln for ln in stderr.splitlines() if ln.startswith("recovered the generation worker")]
    assert len(lines) == len(rows), stderr[-3000:]
    metrics = read_jsonl(dirs.logs / "metrics.jsonl")
    groups = [g for r in metrics for g in r["groups"]]
    assert len(groups) == len(set(groups)) == steps * prompts
    for row in metrics:  # the refit check: the new worker serves the trainer's weights at their version
        assert row["gen_logprob_abs_err"] < REFIT_CHECK, row
    return rows


def resent_from_their_own_cut(dirs: RunDirs) -> list[dict]:
    """The model calls that continued from a cut of themselves (the cut's call id is the call's own: its
    rollout at the same attempt), as the steps' rows record them."""
    calls = [c for r in read_jsonl(dirs.logs / "metrics.jsonl") for c in r.get("prefix_continuations", [])]
    return [c for c in calls if c["call_id"].rsplit(".", 1)[0] == c["rollout_id"] and c["discarded"] is None]


@pytest.mark.alone  # CPU-bound (the torch worker decodes): shares no core under xdist
@pytest.mark.parametrize("lookahead", [0, 1], ids=["sync", "async"])
def test_turn_level_a_killed_worker_is_restarted_and_its_calls_sent_again(tmp_path, lookahead):
    dirs, fault, outcome, stderr = run_with_worker_fault(tmp_path, "turn", {}, lookahead=lookahead)
    rows = check_generation_recovered(dirs, fault, outcome, stderr)
    assert rows[0]["calls_continued_from_cut"] == 0 and rows[0]["tokens_kept"] == 0, rows  # turn: no cuts
    assert "died (pid " in rows[0]["cause"], rows
    from nemo_rl.cli.inspect import inspect, render

    args = _args(dirs, tmp_path / "my-llama", "turn", lookahead=lookahead)
    report = inspect(str(dirs.ckpt), args[1], args[2:])  # the inspector shows the last recoveries
    assert report["recoveries"] == rows
    assert "in-run recovery: generation worker died (pid " in render(report)
    assert "generation restarted" in (tmp_path / "out.txt").read_text()  # the end-of-run table


@pytest.mark.alone
@pytest.mark.parametrize("lookahead", [0, 1], ids=["sync", "async"])
def test_prefix_level_a_killed_worker_continues_each_call_from_its_own_cut(tmp_path, lookahead):
    # The worker is killed while a call a committed snapshot cut is still decoding: the decode hold keeps the
    # first pinned batch mid-decode until the kill (``UNTIL_KILL_ENV``), so the test cannot pass or fail by timing.
    # The restart-only agents are at turn level, so every pinned call is one a snapshot saves (a cut of an unsaved
    # rollout is pinned but never kept: a hold on such a batch would wait for a saved cut that never comes).
    dirs, fault, outcome, stderr = run_with_worker_fault(
        tmp_path, "prefix", {"cuts": True, "until_kill": tmp_path / "held-until-kill"}, lookahead=lookahead,
        extra=("rollout_recovery.agent_target_level_overrides="
               "{sandbox_simple_agent: turn, workplace_restart_only_agent: turn}",))
    assert "decode hold: holding a pinned batch until this worker is killed" in \
        (dirs.logs / "generation" / "worker-1.log").read_text(errors="replace")
    rows = check_generation_recovered(dirs, fault, outcome, stderr)
    assert len(rows) == 1 and rows[0]["calls_continued_from_cut"] > 0 and rows[0]["tokens_kept"] > 0, rows
    with_cuts = rows
    own = resent_from_their_own_cut(dirs)
    assert own, "no call continued from a cut of itself"
    assert sum(c["token_count"] for c in own) >= sum(r["tokens_kept"] for r in with_cuts) > 0


@pytest.mark.alone
def test_a_stopped_worker_is_found_within_the_bound_and_replaced(tmp_path):
    """SIGSTOP: Ray still calls the actor alive; its silence past ``hung_after_s`` (5 s here) is the loss, and
    the stopped process is killed and replaced, long before a model call's 600 s timeout."""
    dirs, fault, outcome, stderr = run_with_worker_fault(tmp_path, "turn", {"sig": signal.SIGSTOP})
    rows = check_generation_recovered(dirs, fault, outcome, stderr)
    assert "did not answer for 5 s" in rows[0]["cause"], rows
    assert rows[0]["seconds_to_redispatch"] < 60, rows


@pytest.mark.alone
def test_a_crash_loop_stops_the_run_naming_the_worker_and_its_log(tmp_path):
    """Each new worker is killed as soon as it is up (a start killed counts as a recovery too): the third loss
    is past ``rollout_recovery.in_run.max_recoveries=2`` and the run stops with one ``error:`` line naming the
    worker and its log, and nothing of it left running."""
    dirs, fault, outcome, stderr = run_with_worker_fault(
        tmp_path, "turn", {"times": 3, "wait_row": False},
        extra=("rollout_recovery.in_run.max_recoveries=2", "grpo.max_num_steps=30"))
    assert len(fault.sent) == 3, (fault.sent, stderr[-3000:])
    assert outcome.returncode == 1, stderr[-3000:]
    assert not outcome.leftover
    errors = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, errors
    assert "generation worker (torch, ray::GenerationServer)" in errors[0] and "max_recoveries=2" in errors[0]
    named = errors[0].split("its log ", 1)[1].split(",", 1)[0]
    assert Path(named).parent == dirs.logs / "generation" and Path(named).is_file(), errors[0]


@pytest.mark.alone
def test_a_sigterm_while_the_worker_is_restarted_takes_a_final_snapshot_and_the_relaunch_finishes(tmp_path):
    """The worker is SIGKILLed and, before its replacement is up, the run gets a SIGTERM: the final snapshot
    commits without the worker (the model servers' held calls are in it as ever), the run exits 143 with
    nothing left running, and the same command continues from that snapshot to the end, every group once."""
    from tests.model_fixtures import llama_dir
    from testkit.run_harness import run_env

    dirs = RunDirs(tmp_path / "run")
    model = llama_dir(tmp_path / "my-llama")
    fault = WorkerFault(dirs)

    def killed(elapsed: float) -> bool:
        fault.tick(elapsed)
        return bool(fault.sent)

    def sigterm(proc) -> str:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        return "sigterm"

    args = _args(dirs, model, "turn")
    stopped = run_once(args, env=run_env(), kill_when=killed, stop=sigterm, timeout_s=540,
                       stdout_path=tmp_path / "out1.txt", stderr_path=tmp_path / "err1.txt")
    stderr = (tmp_path / "err1.txt").read_text(errors="replace")
    assert fault.sent and stopped.returncode == 143, stderr[-3000:]
    assert not stopped.leftover
    final = [r for r in read_jsonl(dirs.logs / "snapshots.jsonl") if r.get("requested") == "SIGTERM"]
    assert len(final) == 1 and final[0]["committed"], (final, stderr[-3000:])
    relaunch = run_once(args, env=run_env(), timeout_s=540, stdout_path=tmp_path / "out2.txt",
                        stderr_path=tmp_path / "err2.txt")
    assert relaunch.returncode == 0, (tmp_path / "err2.txt").read_text(errors="replace")[-3000:]
    assert dirs.restore_json()["snapshot"] == final[0]["path"]
    groups = [g for r in read_jsonl(dirs.logs / "metrics.jsonl") for g in r["groups"]]
    assert len(groups) == len(set(groups)) == STEPS * PROMPTS
    assert not relaunch.leftover


@pytest.mark.alone
def test_the_backend_restart_ends_a_refit_stuck_on_a_stopped_worker_and_gives_up_when_ray_cannot_place_one(
        tmp_path, ray_cluster):
    """``RayGenerationBackend`` itself: after a real GRPO step the worker is SIGSTOPped and a refit hangs on
    it; the restart kills it (stopped as it is), the refit returns, and the new worker serves the trained
    weights at their version (its logprobs are the trainer's). Then, with every CPU taken, a restart raises
    within its bound, or at once when asked to stop (the recovery's thread never outlives it)."""
    import threading

    import asyncio

    import aiohttp
    import torch

    from nemo_rl.algorithms.grpo import GRPOTrainer
    from nemo_rl.algorithms.single_controller_utils.components import GRPOTrainerAdapter, RayGenerationBackend
    from nemo_rl.algorithms.single_controller_utils.config import load_config
    from nemo_rl.experience.sample import ModelCall, RolloutSample
    from nemo_rl.models.policy import load_policy
    from tests.model_fixtures import llama_dir
    from gym_patches.utils.processes import free_port

    torch.set_num_threads(1)
    model = llama_dir(tmp_path / "my-llama")
    config = load_config(TWO_SHARDS, [f"policy.model_name={model}", f"logger.log_dir={tmp_path / 'logs'}"])
    policy = load_policy(str(model), "float32", "cpu", config.policy.max_seq_len)
    trainer = GRPOTrainerAdapter(GRPOTrainer(config.policy.trainer_policy(), config.loss_fn, config.grpo, policy))
    backend = RayGenerationBackend(config, str(model), trainer, free_port(), log_dir=tmp_path / "logs")
    try:
        async def replies():
            body = {"messages": [{"role": "user", "content": "Invite bo to a meeting"}], "max_tokens": 12}
            async with aiohttp.ClientSession() as s:
                outs = []
                for _ in range(4):
                    async with s.post(backend.base_url + "/chat/completions", json=body) as r:
                        outs.append(await r.json())
                return outs

        outs = asyncio.run(replies())
        samples = [RolloutSample(rollout_id=f"g_g{i}", group_id="g", generation_index=i, reward=float(i % 2),
                                 calls=[ModelCall(prompt_token_ids=o["prompt_token_ids"],
                                                  generation_token_ids=o["generation_token_ids"],
                                                  generation_log_probs=o["generation_log_probs"],
                                                  weight_version=o["weight_version"])])
                   for i, o in enumerate(outs)]
        trainer.train_step(samples)
        assert trainer.weight_version == 1
        stopped = generation_worker_pid(tmp_path / "logs")
        os.kill(stopped, signal.SIGSTOP)
        backend.restart_wait_s = 60.0
        refit = threading.Thread(target=backend.refit, args=(trainer,))
        refit.start()
        refit.join(2.0)
        assert refit.is_alive()  # stuck on the stopped worker
        backend.restart(trainer, time.monotonic() + 120.0)
        refit.join(60.0)
        assert not refit.is_alive()
        assert not Path(f"/proc/{stopped}").exists() or "Z" in Path(f"/proc/{stopped}/stat").read_text().split()[2]
        assert ray.get(backend.worker.weight_version.remote()) == 1 and backend.starts == 2
        prompt, gen = outs[1]["prompt_token_ids"], outs[1]["generation_token_ids"]
        served = ray.get(backend.worker.logprobs.remote(prompt, gen))
        assert torch.allclose(trainer.inner.policy.token_logprobs(prompt, gen, 1.0), torch.tensor(served), atol=1e-4)
        # A new worker Ray cannot place (every CPU taken): the restart gives up within its bound, not never.
        ray.kill(backend.worker, no_restart=True)
        deadline = time.monotonic() + 30
        while ray.available_resources().get("CPU", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        blocker = Hog.options(num_cpus=ray.available_resources()["CPU"]).remote()
        ray.get(blocker.ready.remote())
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="did not start in time"):
            backend.restart(trainer, time.monotonic() + 3.0)
        assert time.monotonic() - started < 20
        # ... and one asked to stop (the recovery cancelled: the run ends) ends at once, whatever its deadline.
        with pytest.raises(TimeoutError):
            backend.restart(trainer, time.monotonic() + 300.0, stop=lambda: True)
        assert time.monotonic() - started < 30
        ray.kill(blocker)
    finally:
        backend.stop()


@ray.remote
class Hog:
    """Holds the CPUs it was given (a cluster with no room for a new worker)."""

    def ready(self) -> bool:
        return True
