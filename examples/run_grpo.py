"""GRPO with turn-level rollout recovery: ``python examples/run_grpo.py [--config X.yaml] [key=value ...]``.

With no arguments it runs the embedded default: local Ray, Gym servers on
loopback, the tiny CPU policy, the Workplace setup with turn recovery. Running
the same command again after a crash resumes from the newest checkpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
os.chdir(REPO_ROOT) if os.environ.get("NEMO_RL_CHDIR_REPO", "1") == "1" else None

from nemo_rl.algorithms.single_controller_utils.config import ConfigError, load_config  # noqa: E402


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="YAML config (default: the embedded default)")
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    launched = time.monotonic()
    try:
        config = load_config(args.config, overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from nemo_rl.utils.fault_injection import check_crash_env

    from gym_patches.testing.write_faults import WRITE_FAULT_ENV, parse_write_fault

    try:
        check_crash_env()  # test-only crash hook: a malformed value fails here, not silently later
        parse_write_fault(os.environ.get(WRITE_FAULT_ENV))  # test-only write fault, likewise
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    from nemo_rl.algorithms.single_controller_utils.runner import run

    # Test-only: lets the RL-level stall regression test reach the snapshot loop.
    skip_check = os.environ.get("NEMO_RL_TEST_ONLY_SKIP_RESTART_ONLY_CHECK") == "1"
    from gym_patches.config import GymConfigError
    from nemo_rl.utils.write_errors import RunWriteError

    try:
        return run(config, launched_at=launched, skip_restart_only_check=skip_check)
    except GymConfigError as exc:  # a bad key in the Gym config: a config error like the RL ones
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RunWriteError as exc:  # a file the run writes (checkpoint, records, logs) could not be written: it is named
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
