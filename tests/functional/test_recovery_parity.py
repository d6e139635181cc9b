"""Recovery parity (``nemo_rl/parity``), end to end: the harness on the Workplace config of two Gym replicas
with the embedded tiny model (real runs, real Ray, real Gym servers, the torch worker in deterministic
mode). One clean reference run per level is shared by the module's tests; each test runs the same config
under faults and must train on exactly what the reference trained: the same groups, token ids, masks and
rewards, logprobs and advantages within 1e-5 / 1e-6, the same metrics, and the same final weights bit for
bit. A mutation (a restored turn whose logprob is moved) must fail it, naming the first differing sample.

The warm start is longer than the suite's usual 30 steps (150): with 30 the tiny model never calls a tool,
so every rollout is one model call and a turn-level restore would have no earlier turn to keep. Rewards
are mostly 0 at that size, so every advantage would be 0 and no sample would move the weights; a KL
penalty and weight decay make every sample's tokens count in every step after the first (the KL term's
gradient is 0 while the weights equal the reference's, and weight decay moves them in step 1).

The harness spreads the faults over the steps (its seed draws the trained steps each waits for); once one
is armed, the generation worker holds its call mid-decode until the fault is delivered
(``testkit/parity_seams``: the gate), so each finds a committed snapshot holding rollouts in flight on any
machine, not only on one slow enough for the step to last.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from nemo_rl.parity.drive import FAULT_STATE
from nemo_rl.parity.harness import render_result, run_parity, run_reference
from nemo_rl.parity.launch import RunPlace
from nemo_rl.parity.trace import read_step_traces
from testkit.run_harness import REPO, run_env

pytestmark = [pytest.mark.functional, pytest.mark.timeout(900), pytest.mark.alone]

CONFIG = "examples/configs/grpo_workplace_two_replicas_turn.yaml"
ENTRY = (sys.executable, "-m", "testkit.run_grpo")  # the product's main; the seams come from PYTHONPATH
SEAMS = REPO / "testkit" / "parity_seams"
HOLD_TOKENS = 4
BASE = ["grpo.max_num_steps=3", "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2",
        "policy.warm_start.steps=150", "logger.plot=false", "logger.progress_bar=false",
        "rollout_checkpointing.snapshot_attempt_interval_s=0.2", "rollout_checkpointing.keep_latest_k=4",
        "loss_fn.reference_policy_kl_penalty=0.05", "policy.weight_decay=0.01",
        "rollout_recovery.in_run.hung_after_s=5"]
RESTORED = re.compile(r"-a[0-9]+$")


def _overrides(cache: Path, level: str) -> list[str]:
    return [*BASE, f"policy.cache_dir={cache}", f"rollout_recovery.target_level={level}"]


def _env(workdir: Path, mutation: str | None = None) -> dict[str, str]:
    extra = {"NEMO_RL_TEST_ONLY_PARITY_GATE": f"{workdir / 'faulted' / FAULT_STATE}|{HOLD_TOKENS}"}
    if mutation is not None:
        extra["NEMO_RL_TEST_ONLY_PARITY_MUTATION"] = mutation
    return run_env(pythonpath=[SEAMS], extra=extra)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("parity_model_cache")


def _reference(tmp_path_factory, cache: Path, level: str) -> RunPlace:
    root = tmp_path_factory.mktemp(f"parity_reference_{level}")
    place, outcome = run_reference(CONFIG, _overrides(cache, level), root / "run", entry=ENTRY, env=run_env())
    assert outcome.error is None, outcome.error
    return place


@pytest.fixture(scope="module")
def turn_reference(tmp_path_factory, cache) -> RunPlace:
    return _reference(tmp_path_factory, cache, "turn")


@pytest.fixture(scope="module")
def prefix_reference(tmp_path_factory, cache) -> RunPlace:
    return _reference(tmp_path_factory, cache, "prefix")


def _parity(tmp_path: Path, cache: Path, reference: RunPlace, level: str, faults: str, *, seed: int = 0,
            mutation: str | None = None):
    lines: list[str] = []
    result = run_parity(CONFIG, _overrides(cache, level), faults, tmp_path, reference=reference.root, seed=seed,
                        entry=ENTRY, env=run_env(), faulted_env=_env(tmp_path, mutation),
                        launch_timeout_s=400, log=lines.append)
    text = render_result(result)
    print("\n".join(lines) + "\n" + text)
    return result, text


def _restored_samples(place: RunPlace) -> list[str]:
    return [s.rollout_id for t in read_step_traces(place.logs).values() for s in t.samples
            if RESTORED.search(s.rollout_id)]


def _held(place: RunPlace) -> bool:
    return any("parity gate: a call was held" in p.read_text(errors="replace")
               for p in (place.logs / "generation").glob("worker-*.log"))


def _assert_parity(result, text: str) -> None:
    assert result.error is None, text
    assert not result.faulted.undelivered, text
    assert result.exit_code == 0 and result.report.ok, text
    assert all(r.token_ids == r.masks == r.rewards == "exact" for r in result.report.rows), text
    assert result.report.weights is not None and result.report.weights.exact, text


def test_turn_two_whole_run_kills_at_random_snapshots_train_exactly_the_reference(tmp_path, cache, turn_reference):
    result, text = _parity(tmp_path, cache, turn_reference, "turn", "kill,kill", seed=1)
    _assert_parity(result, text)
    faulted = RunPlace(tmp_path / "faulted")
    assert [launch["returncode"] for launch in result.faulted.launches] == [-9, -9, 0], text
    assert _held(faulted)
    restored = _restored_samples(faulted)
    assert restored, "no trained sample came from a rollout restored at its turn: the kills saved nothing"


def test_turn_sigterm_then_a_relaunch_on_one_replica_trains_exactly_the_reference(tmp_path, cache, turn_reference):
    result, text = _parity(tmp_path, cache, turn_reference, "turn", "term:replicas=1")
    _assert_parity(result, text)
    assert [launch["returncode"] for launch in result.faulted.launches] == [143, 0], text
    second = result.faulted.launches[1]["argv"]
    assert "env.nemo_gym.shards.0.replicas=1" in second
    assert _restored_samples(RunPlace(tmp_path / "faulted")), "the final snapshot restored nothing at its turn"


def test_turn_in_run_losses_of_each_kind_train_exactly_the_reference(tmp_path, cache, turn_reference):
    result, text = _parity(tmp_path, cache, turn_reference, "turn", "server,replica,worker,stop")
    _assert_parity(result, text)
    faulted = RunPlace(tmp_path / "faulted")
    rows = [json.loads(line) for line in (faulted.logs / "recoveries.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and {r["part"] for r in rows} >= {"generation", "replica"}, rows
    server, replica, worker, stop = (row["pids"] for row in result.faulted.delivered)
    assert list(server) == ["policy_model"] and list(stop) == ["workplace_simple_agent"], result.faulted.delivered
    assert {"actor", "policy_model", "workplace_assistant", "workplace_simple_agent"} <= set(replica)
    assert list(worker) == ["generation worker"]
    assert len(result.faulted.launches) == 1 and result.faulted.launches[0]["returncode"] == 0


def test_turn_a_restored_turn_with_a_moved_logprob_fails_parity_naming_the_sample(tmp_path, cache, turn_reference):
    result, text = _parity(tmp_path, cache, turn_reference, "turn", "kill", mutation="restored_logprobs")
    assert result.error is None and not result.faulted.undelivered, text
    assert result.exit_code == 1, text
    first = result.report.first
    assert first is not None and first.what == "logprob", text
    assert RESTORED.search(first.rollout) and first.group and first.sample is not None and first.token is not None
    assert abs(first.faulted - first.reference - 0.01) < 1e-6, first
    assert f"first difference: step {first.step}, group {first.group}, sample {first.sample}" in text


def test_prefix_a_kill_and_a_worker_loss_continue_cuts_and_train_exactly_the_reference(tmp_path, cache, prefix_reference):
    result, text = _parity(tmp_path, cache, prefix_reference, "prefix", "kill,worker")
    _assert_parity(result, text)
    faulted = RunPlace(tmp_path / "faulted")
    metrics = [json.loads(line) for line in (faulted.logs / "metrics.jsonl").read_text().splitlines()]
    continued = sum(m.get("prefix_continued_calls", 0) for m in metrics)
    assert continued > 0, "no call continued from a generation cut: the faults tested turn level only"
