"""``rollout_recovery.target_level: prefix`` on real crashed runs.

A GRPO run on two Gym shards of two replicas each (one shard saves, one is the mixed restart-only
setup; ``allow_restart_only_gym_servers=true``) with a Hugging Face model the code did not create
(a random Llama from a directory) on the torch worker, every call decoding to its token limit
(``policy.generation.ignore_eos``) so calls span several snapshot intervals. The whole run is
SIGKILLed once a committed snapshot holds generation cuts; the same command then runs to the end.
Checked: each cut of a restored rollout continues exactly once with the same (call id, token count,
digest); its tail has > 0 tokens and prefix + tail is the call's whole generation; the trained
tokens start with the cut's; every prompt group is trained exactly once.

Also: with a backend that has no cut support (the scripted fake), ``prefix`` never blocks a snapshot;
each row says the cut failed and why.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from gym_patches.checkpoint.cuts import GenerationCut
from tests.functional.rl_run import RunDirs, env_for, replies, run_grpo, run_until_then_kill
from testkit.run_harness import run_env

pytestmark = [pytest.mark.functional, pytest.mark.timeout(900)]

MAX_NEW = 96  # the data rows' max_output_tokens: every call decodes exactly this many (ignore_eos)
STEPS, PROMPTS, GENERATIONS = 2, 4, 2
# The killed run's generation worker holds each batch at HOLD_TOKENS tokens until two snapshots' cuts have
# pinned it (tests/functional/decode_hold/sitecustomize.py): a committed snapshot with cuts is certain on any
# machine, and the kill comes at the first one (the relaunch runs without the hold).
HOLD_TOKENS = 24
HOLD_DIR = Path(__file__).resolve().parent / "decode_hold"
TWO_SHARDS = "examples/configs/grpo_mixed_two_shards_turn.yaml"


def _args(dirs: RunDirs, model: Path) -> list[str]:
    return [
        "--config", TWO_SHARDS, *dirs.overrides(), f"policy.model_name={model}", "logger.plot=false",
        "rollout_recovery.target_level=prefix", "rollout_recovery.allow_restart_only_gym_servers=true",
        "policy.generation.ignore_eos=true",
        f"grpo.max_num_steps={STEPS}", f"grpo.num_prompts_per_step={PROMPTS}",
        f"grpo.num_generations_per_prompt={GENERATIONS}", "grpo.val_period=0", "grpo.val_at_start=false",
        "rollout_checkpointing.snapshot_attempt_interval_s=0.1", "rollout_checkpointing.keep_latest_k=50",
    ]


def hold_env_kw() -> dict:
    """``run_env``'s keywords for the decode hold (``decode_hold/sitecustomize.py``) at ``HOLD_TOKENS``."""
    return {"pythonpath": [HOLD_DIR], "extra": {"NEMO_RL_TEST_ONLY_DECODE_HOLD": str(HOLD_TOKENS)}}


def held_env() -> dict[str, str]:
    """A run's environment with the decode hold."""
    return run_env(**hold_env_kw())


def assert_held(log_dir: Path) -> None:
    """The hold really held a batch in a generation worker of the run (its log says so): a test that relies
    on it must not pass by timing alone."""
    logs = sorted((Path(log_dir) / "generation").glob("worker-*.log"))
    assert any("decode hold: a batch was held" in p.read_text(errors="replace") for p in logs), \
        f"the decode hold held no batch (worker logs: {[str(p) for p in logs]})"


def _snapshot_with_cuts(dirs: RunDirs) -> bool:
    """The newest committed snapshot holds a cut: the relaunch restores the newest, and at a 0.1 s interval
    a later snapshot without one can commit between an older cut's row and the kill."""
    committed = [r for r in dirs.records("snapshots.jsonl") if r.get("committed")]
    return bool(committed) and committed[-1].get("cuts", 0) > 0


def _saved_cuts(snapshot: Path) -> dict[str, GenerationCut]:
    """capture key -> the cut the snapshot's model records hold (read from Gym's own files)."""
    cuts = {}
    for path in snapshot.rglob("gym/model/*/records-*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record.get("cut"):
                e = record["episode_id"]
                key = e["rollout_id"] if e["attempt"] == 0 else f"{e['rollout_id']}-a{e['attempt']}"
                cuts[key] = GenerationCut.model_validate(record["cut"])
                assert record["cut_tokens"] == cuts[key].token_count
    return cuts


def _previous_key(key: str) -> str:
    base, _, attempt = key.rpartition("-a")
    return base if attempt == "1" else f"{base}-a{int(attempt) - 1}"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from tests.model_fixtures import llama_dir

    return llama_dir(tmp_path_factory.mktemp("model") / "my-llama")


def test_a_crash_after_a_snapshot_with_cuts_continues_each_cut_once(model, tmp_path):
    dirs = RunDirs(tmp_path)
    args = _args(dirs, model)
    run_until_then_kill(args, env=held_env(), until=lambda: _snapshot_with_cuts(dirs), timeout_s=400)
    assert_held(dirs.logs)
    killed_rows = dirs.records("snapshots.jsonl")
    # the cuts of every published snapshot, read now: the relaunch prunes the one it restores once its
    # newer trainer steps are published
    saved = {r["path"]: _saved_cuts(Path(r["path"])) for r in killed_rows
             if r.get("committed") and r.get("path") and Path(r["path"]).is_dir()}
    proc = run_grpo(args, env=env_for(), timeout_s=600)
    assert proc.returncode == 0, proc.stderr[-3000:]

    restore = dirs.restore_record()
    assert restore is not None and restore["snapshot"], restore
    assert restore["snapshot"] in saved, (restore["snapshot"], sorted(saved))
    cuts = saved[restore["snapshot"]]
    assert cuts, "the restored snapshot holds no generation cut"
    restored = restore["restored_prefix_tokens"]  # new capture key -> prefix tokens
    assert restore["restored_prefix"] == len(restored) >= 1 and restore["prefix_tokens"] == sum(restored.values())
    for new_key, tokens in restored.items():
        assert cuts[_previous_key(new_key)].token_count == tokens

    rows = dirs.records("metrics.jsonl")
    continued = [c for r in rows for c in r.get("prefix_continuations", [])]
    by_call: dict[str, list[dict]] = {}
    for c in continued:
        by_call.setdefault(c["call_id"], []).append(c)
    with_tail = 0
    for new_key in restored:
        cut = cuts[_previous_key(new_key)]
        uses = by_call.get(cut.call_id, [])
        assert len(uses) == 1, (new_key, uses)  # exactly once
        use = uses[0]
        assert (use["token_count"], use["digest"], use["discarded"]) == (cut.token_count, cut.digest, None)
        assert use["rollout_id"] == new_key
        tokens, _ = cut.unpack()
        # what the trainer got starts with the cut's tokens: prefix + tail = the whole generation
        assert use["prefix_sha256"] == hashlib.sha256(json.dumps(tokens).encode()).hexdigest()
        assert use["generation_tokens"] == MAX_NEW
        tail = use["generation_tokens"] - use["token_count"]
        if cut.token_count < MAX_NEW:
            assert tail > 0
            with_tail += 1
    assert with_tail >= 1
    assert sum(r.get("prefix_continued_calls", 0) for r in rows) == len(restored)

    # every prompt group trained exactly once, in the rows of the final lineage
    groups = [g for r in rows for g in r["groups"]]
    assert sorted({r["step"] for r in rows}) == list(range(1, STEPS + 1))
    assert len(groups) == len(set(groups)) == STEPS * PROMPTS
    # the snapshot rows say what was cut; none failed on this backend
    cut_rows = [r for r in killed_rows if r.get("committed") and r.get("cuts")]
    assert cut_rows and all(r["cut_tokens"] >= r["cuts"] and "cut_error" not in r for r in cut_rows)
    # the mixed shard's rollouts were unsaved (restart-only servers, best effort), never cut
    assert any(r.get("unsaved") for r in killed_rows if r.get("committed"))
    print(f"\nrestored {len(restored)} cuts ({sum(restored.values())} tokens) of {len(cuts)} saved; "
          f"{restore['restarted_from_prompt']} restarted from the prompt")


def test_prefix_without_cut_support_never_blocks_a_snapshot_and_says_why(tmp_path):
    dirs = RunDirs(tmp_path)
    args = ["--config", "examples/configs/grpo_workplace_turn.yaml", *dirs.overrides(),
            "policy.model_name=scripted-test-backend", "logger.plot=false", *replies(0.4),
            "rollout_recovery.target_level=prefix", "grpo.max_num_steps=1", "grpo.num_prompts_per_step=2",
            "rollout_checkpointing.snapshot_attempt_interval_s=0.25"]
    proc = run_grpo(args, env=env_for(), timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in dirs.records("snapshots.jsonl") if r.get("committed")]
    assert rows and all("cuts" in r and r["cuts"] == 0 for r in rows)
    failed = [r for r in rows if r["cut_failed"]]
    assert failed, "no snapshot caught a model call in flight"
    assert all("does not support generation cuts" in r["cut_error"] for r in failed)
    assert "generation cuts incomplete" in proc.stderr
