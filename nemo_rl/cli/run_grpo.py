"""GRPO with turn-level rollout recovery: ``main(argv, hooks=...)``, what ``examples/run_grpo.py`` runs.

Exit codes: 0 done (or nothing left to do), 2 a config error (an RL or Gym key,
named), 1 a run that failed (a file it could not write, named; a setup or
runtime error), each as one ``error:`` line on stderr. ``hooks`` are where
tests act on the run (``nemo_rl.utils.run_hooks``); the product passes none.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from nemo_rl.algorithms.single_controller_utils.config import ConfigError, load_config
from nemo_rl.utils.run_hooks import RunHooks

USAGE = """GRPO with turn-level rollout recovery: ``python examples/run_grpo.py [--config X.yaml] [key=value ...]``.

With no arguments it runs the embedded default: local Ray, Gym servers on
loopback, the tiny CPU policy, the Workplace setup with turn recovery. Running
the same command again after a crash resumes from the newest checkpoint.
"""


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="YAML config (default: the embedded default)")
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None, *, hooks: RunHooks | None = None) -> int:
    args, overrides = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    launched = time.monotonic()
    try:
        config = load_config(args.config, overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    from gym_patches.config import GymConfigError
    from nemo_rl.algorithms.single_controller_utils.runner import run
    from nemo_rl.utils.write_errors import RunWriteError

    try:
        return run(config, launched_at=launched, hooks=hooks)
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
