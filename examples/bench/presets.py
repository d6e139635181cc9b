"""Parameters of each measurement for the full run, ``--quick``, the smoke test and the other presets."""

from __future__ import annotations

from typing import Any

ALL_EXPERIMENTS = [(setup, level) for setup in ("workplace", "mixed") for level in ("turn", "sibling", "prompt_group")]

FULL: dict[str, dict[str, Any]] = {
    "snapshot_cost": {"sizes": [8, 64, 512, 2048], "repeats": 5, "tmpfs_sizes": [512]},
    "stall": {"attempts": 5, "deadline_s": 2.0},
    "work_lost": {"experiments": ALL_EXPERIMENTS, "seeds": [0, 1]},
    "alternative": {"window_s": 15.0, "repeats": 2},
    "overhead": {"repeats": 3},
    "setup_check": {"repeats": 3},
    "relaunch": {"repeats": 3},
    "bookkeeping": {"sizes_mb": [10, 100, 1024], "saves": 6, "keep": 3, "compare_full_verify": True},
}

QUICK: dict[str, dict[str, Any]] = {
    "snapshot_cost": {"sizes": [8, 64], "repeats": 2},
    "stall": {"attempts": 3, "deadline_s": 1.0},
    "work_lost": {"experiments": [("mixed", "turn")], "seeds": [0]},
    "alternative": {"window_s": 4.0, "repeats": 1, "controller_steps": 3},
    "overhead": {"repeats": 1, "steps": 4, "turns": (10,), "seconds": (1.0,)},
    "setup_check": {"repeats": 1},
    "relaunch": {"repeats": 1},
    "bookkeeping": {"sizes_mb": [10], "saves": 4, "keep": 3, "compare_full_verify": True},
}

# The smoke test: the smallest configuration that still exercises every code path.
TINY: dict[str, dict[str, Any]] = {
    "snapshot_cost": {"sizes": [8], "repeats": 1, "tool_s": 0.3, "delay_s": 1.5, "tool_delay_s": 0.6,
                      "interval_s": 0.5},
    "stall": {"attempts": 1, "deadline_s": 0.4, "gap_s": 0.2, "prompts": 4},
    "work_lost": {"experiments": [("workplace", "turn")], "seeds": [0], "steps": 2, "delay_s": 0.3,
                  "interval_s": 0.25, "crash_window": (0.3, 0.6)},
    "alternative": {"window_s": 1.6, "repeats": 1, "warmup_s": 0.6, "controller_steps": 2, "controller_prompts": 2,
                    "concurrency": 8},
    "overhead": {"repeats": 1, "steps": 2, "prompts": 2, "generations": 2, "turns": (3,), "seconds": (1.0,),
                 "delay_s": 0.3},
    "setup_check": {"repeats": 1},
    "relaunch": {"repeats": 1, "prompts": 2, "generations": 2, "delay_s": 0.3, "interval_s": 0.3},
    "bookkeeping": {"sizes_mb": [1], "saves": 4, "keep": 3, "compare_full_verify": True},
}

COMMIT_MODES = [("staged", ["rollout_checkpointing.commit_mode=staged"]),
                ("blocking", ["rollout_checkpointing.commit_mode=blocking"])]

# Issue 21's scale, 512 prompts x 16 generations = 8192 rollouts in flight, next to N = 2048 (128 x 16),
# both on one Gym replica; idle and 0.5 s tools; both commit modes (``--variant`` replaces them); and
# the trainer-checkpoint bookkeeping rows. 8 GRPO runs: about 15 minutes on 2 cores, under 25 even if
# every run ran to its ``timeout_s`` (then it is stopped and reports what it had). A run stops once it
# has ``repeats`` steady attempts; ``steps`` leaves room for more steps (each step at 8192 begins with
# burst attempts). Tool runs get the idle runs' 3 s per reply, not 1.5 s: at 8192 a replica admits the
# step's /run calls for about 45 s, and at 1.5 s enough rollouts had ended by then that no later attempt
# held 95 % of N, so the tool runs had no steady attempt at all (measured while choosing it).
N8192: dict[str, dict[str, Any]] = {
    "snapshot_cost": {"sizes": [2048, 8192], "repeats": 4, "generations": 16, "per_replica": 8192, "steps": 6,
                      "tool_delay_s": 3.0, "timeout_s": {2048: 120.0, 8192: 220.0}, "variants": COMMIT_MODES},
    "bookkeeping": {"sizes_mb": [10, 100, 1024], "saves": 6, "keep": 3, "compare_full_verify": True},
}

# Measurement 9, async (lookahead 1) against sync on the main job itself (the tiny HF model, the torch
# generation worker, the real trainer), is a preset of its own: 3 repeats x 6 runs of 16 steps, then
# the main job twice at its 40 steps; about 30 minutes on 2 cores. ``async_tiny`` is its smoke test.
ASYNC: dict[str, dict[str, Any]] = {
    "async_throughput": {"repeats": 3, "steps": 16},
}
ASYNC_TINY: dict[str, dict[str, Any]] = {
    "async_throughput": {"repeats": 1, "steps": 3, "intervals": (1.0,), "prompts": 2, "generations": 2,
                         "learning_steps": 2,
                         "learning_overrides": ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2"]},
}

# Measurement 10, work lost per crash at prefix against turn and the cut's pause at N = 512, on the torch
# worker: a preset of its own (about 5 minutes on 2 cores); ``prefix_tiny`` is its smoke test.
PREFIX: dict[str, dict[str, Any]] = {
    "prefix_work_lost": {"calls": 8, "max_tokens": 400, "interval_s": 0.5, "crashes": 3,
                         "pause_calls": (64, 512), "pause_tokens": 200, "repeats": 7},
}
PREFIX_TINY: dict[str, dict[str, Any]] = {
    "prefix_work_lost": {"calls": 4, "max_tokens": 320, "interval_s": 0.25, "crashes": 1,
                         "pause_calls": (16,), "pause_tokens": 40, "pause_max_tokens": 96, "repeats": 2},
}

# Measurement 11, work lost per preemption with the final snapshot against before it (a SIGKILL of the
# group: restore from the newest periodic snapshot), at the main job's 5 s interval and at 120 s, 3 seeds
# (12 stopped runs, each relaunched), and seconds from SIGTERM to exit at N = 512 and 8192 in flight: a
# preset of its own (about 25-30 minutes on 2 cores). ``preemption_smoke`` checks that it works (2-3 min).
PREEMPTION: dict[str, dict[str, Any]] = {
    "preemption": {"intervals": (5.0, 120.0), "seeds": (0, 1, 2), "delay_s": 2.0, "steps": 3, "window": (1.0, 5.0),
                   "sizes": (512, 8192), "exit_repeats": 1,
                   "exit_delay_s": {512: 10.0, 8192: 60.0}, "exit_timeout_s": {512: 240.0, 8192: 480.0}},
}
# The same with two seeds (8 stopped runs): what fits beside a session's other work, about 15 minutes.
PREEMPTION_QUICK: dict[str, dict[str, Any]] = {
    "preemption": {**PREEMPTION["preemption"], "seeds": (0, 1)},
}
PREEMPTION_SMOKE: dict[str, dict[str, Any]] = {
    "preemption": {"intervals": (120.0,), "seeds": (0,), "delay_s": 0.4, "steps": 2, "window": (0.3, 0.6),
                   "timeout_s": 180.0, "sizes": (32,), "exit_repeats": 1, "generations": 8,
                   "exit_delay_s": 2.0, "exit_timeout_s": 150.0},
}

# Measurement 14, in-run recovery of a Gym server and of a Gym replica: a preset of its own (3 repeats of
# each kind, about 5 minutes on 2 cores); ``gym_recovery_smoke`` is its smoke test.
GYM_RECOVERY: dict[str, dict[str, Any]] = {"gym_recovery": {"repeats": 3}}
GYM_RECOVERY_SMOKE: dict[str, dict[str, Any]] = {
    "gym_recovery": {"repeats": 1, "steps": 3, "prompts": 4, "generations": 2, "delay_s": 0.3, "interval_s": 0.3,
                     "window_s": 2.0, "min_saved_calls": 1},
}

# Measurement 15, a relaunch with a model of about 1 GB (270M float32 parameters): what it reads of the trainer
# step, what it ships to generation and its time by phase; 3 repeats of two runs with the real trainer (each
# step directory about 3.3 GB: weights and Adam's moments). A preset of its own; ``restore_io_smoke`` is the
# same with a 1 MB model (about 2 minutes).
RESTORE_IO: dict[str, dict[str, Any]] = {
    "restore_io": {"repeats": 3, "model_mb": 1024, "hidden_size": 1024},
}
RESTORE_IO_SMOKE: dict[str, dict[str, Any]] = {
    "restore_io": {"repeats": 1, "model_mb": 1, "hidden_size": 64, "max_new_tokens": 8, "interval_s": 0.3,
                   "timeout_s": 240.0},
}

# Measurement 16, in-run recovery of the generation worker: 3 repeats at each level with the embedded model
# on the torch worker (about 5 minutes on 2 cores); ``generation_recovery_smoke`` is one prefix-level run.
GENERATION_RECOVERY: dict[str, dict[str, Any]] = {"generation_recovery": {"repeats": 3}}
GENERATION_RECOVERY_SMOKE: dict[str, dict[str, Any]] = {
    "generation_recovery": {"repeats": 1, "levels": ("prefix",), "steps": 3, "prompts": 2, "warm_start_steps": 5},
}

# Measurement 18, in-run recovery of a replica at N = 4096 and 8192 rollouts in flight on two replicas (scripted
# backend): 3 repeats of each, every run stopped once its recovery row is written (about 20 minutes on 2 cores);
# ``recovery_scale_smoke`` is one small run.
RECOVERY_SCALE: dict[str, dict[str, Any]] = {"recovery_scale": {"sizes": (4096, 8192), "repeats": 3}}
RECOVERY_SCALE_SMOKE: dict[str, dict[str, Any]] = {
    "recovery_scale": {"sizes": (16,), "repeats": 1, "generations": 4, "delay_s": 0.3, "interval_s": 0.3,
                       "timeout_s": 240.0},
}

# Measurement 17, what grpo.deterministic costs the main job: 3 repeats of 12 steps, on and off interleaved
# (about 20 minutes on 2 cores); ``deterministic_cost_smoke`` is one short pair.
DETERMINISTIC_COST: dict[str, dict[str, Any]] = {"deterministic_cost": {"repeats": 3, "steps": 12}}
DETERMINISTIC_COST_SMOKE: dict[str, dict[str, Any]] = {
    "deterministic_cost": {"repeats": 1, "steps": 2, "timeout_s": 400.0,
                           "overrides": ("grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2",
                                         "policy.warm_start.steps=5")},
}

# Measurement 19, replay of rollouts on restart-only servers against a restart from the prompt, on one replica of the
# mixed setup (scripted backend): 3 repeats of each arm at N = 128 prompts x 4 generations = 512 rollouts, each held
# after 2 finished turns (1 s per reply), 3 snapshots counted before the kill, then the relaunch; the capture cost
# per interval at 512 episodes (about 20 minutes on 2 cores). ``replay_recovery_smoke`` is one small repeat of each.
REPLAY_RECOVERY: dict[str, dict[str, Any]] = {"replay_recovery": {"repeats": 3}}
REPLAY_RECOVERY_SMOKE: dict[str, dict[str, Any]] = {
    "replay_recovery": {"repeats": 1, "prompts": 2, "generations": 2, "delay_s": 0.3, "interval_s": 0.3,
                        "snapshots_after_hold": 1, "micro_n": 8, "micro_turns": 3, "micro_repeats": 1,
                        "timeout_s": 240.0},
}

PRESETS = {"full": FULL, "quick": QUICK, "tiny": TINY, "n8192": N8192, "async": ASYNC, "async_tiny": ASYNC_TINY,
           "prefix": PREFIX, "prefix_tiny": PREFIX_TINY, "preemption": PREEMPTION,
           "preemption_quick": PREEMPTION_QUICK, "preemption_smoke": PREEMPTION_SMOKE,
           "gym_recovery": GYM_RECOVERY, "gym_recovery_smoke": GYM_RECOVERY_SMOKE,
           "restore_io": RESTORE_IO, "restore_io_smoke": RESTORE_IO_SMOKE,
           "generation_recovery": GENERATION_RECOVERY, "generation_recovery_smoke": GENERATION_RECOVERY_SMOKE,
           "recovery_scale": RECOVERY_SCALE, "recovery_scale_smoke": RECOVERY_SCALE_SMOKE,
           "deterministic_cost": DETERMINISTIC_COST, "deterministic_cost_smoke": DETERMINISTIC_COST_SMOKE,
           "replay_recovery": REPLAY_RECOVERY, "replay_recovery_smoke": REPLAY_RECOVERY_SMOKE}
