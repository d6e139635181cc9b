"""Parameters of each measurement for the full run, ``--quick`` and the smoke test."""

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
}

QUICK: dict[str, dict[str, Any]] = {
    "snapshot_cost": {"sizes": [8, 64], "repeats": 2},
    "stall": {"attempts": 3, "deadline_s": 1.0},
    "work_lost": {"experiments": [("mixed", "turn")], "seeds": [0]},
    "alternative": {"window_s": 4.0, "repeats": 1, "controller_steps": 3},
    "overhead": {"repeats": 1, "steps": 4, "turns": (10,), "seconds": (1.0,)},
    "setup_check": {"repeats": 1},
    "relaunch": {"repeats": 1},
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
}

PRESETS = {"full": FULL, "quick": QUICK, "tiny": TINY}
