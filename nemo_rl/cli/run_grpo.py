"""GRPO with turn-level rollout recovery: ``main(argv, hooks=...)``, what ``examples/run_grpo.py`` runs.

Exit codes: 0 done (or nothing left to do; ``--check``: the setup passes), 2 a
config error (an RL or Gym key, a path or a missing backend, named), 1 a run
that failed (a file it could not write, named; a setup or runtime error;
``--check``: the setup check refused it), each as one ``error:`` line on
stderr. ``hooks`` are where tests act on the run (``nemo_rl.utils.run_hooks``);
the product passes none. ``--help`` is generated from the config schema and
``examples/configs`` (``nemo_rl/cli/usage.py``), so it cannot drift.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from nemo_rl.algorithms.single_controller_utils.config import ConfigError, MasterConfig, load_config
from nemo_rl.utils.run_hooks import RunHooks


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one "error:" line and exit 2, like every config error
        print(f"error: {message}\n{self.format_usage().strip()}\n(--help lists the configs and keys)", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    from nemo_rl.cli.usage import DESCRIPTION, epilog

    parser = _Parser(prog="run_grpo.py", usage="%(prog)s [--config FILE.yaml] [--check] [key.path=value ...]",
                     description=DESCRIPTION, epilog=epilog(), allow_abbrev=False,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, metavar="FILE.yaml",
                        help="YAML config (default: the embedded default); relative to the current directory, "
                             "else to the repository root")
    parser.add_argument("--check", action="store_true",
                        help="validate, print the merged config, start Gym, run the restart-only setup check, "
                             "print every server, stop everything; exit 0 (passes) or 1 (refused)")
    return parser


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """Options and ``key=value`` overrides; an unknown option is an error naming it (exit 2)."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    flags = [a for a in rest if a.startswith("-")]
    if flags:
        parser.error(f"unknown option {flags[0]} (options: --config, --check, --help; "
                     "overrides are key.path=value, without dashes)")
    return args, rest


def start_banner(config_path: str | None, overrides: list[str], config: MasterConfig) -> str:
    """What this run was started with and where it writes: printed once, before anything starts."""
    from pathlib import Path

    from nemo_rl.algorithms.single_controller_utils.config import resolve_config_path

    ckpt = config.checkpointing
    return "\n".join([
        f"config:         {resolve_config_path(config_path) if config_path else 'the embedded default'}",
        f"overrides:      {' '.join(overrides) if overrides else '(none)'}",
        f"log dir:        {Path(config.logger.log_dir).absolute()}",
        f"checkpoint dir: {Path(ckpt.checkpoint_dir).absolute() if ckpt.enabled else '(none: checkpointing.enabled=false)'}",
    ])


def main(argv: list[str] | None = None, *, hooks: RunHooks | None = None) -> int:
    args, overrides = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    launched = time.monotonic()
    from nemo_rl.cli.preflight import prepare

    try:
        config = prepare(load_config(args.config, overrides))  # paths, output dirs, vLLM: before anything starts
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        from nemo_rl.cli.check import check

        return check(config)
    print(start_banner(args.config, overrides, config), flush=True)

    from gym_patches.config import GymConfigError
    from nemo_rl.algorithms.single_controller_utils.runner import run
    from nemo_rl.utils.write_errors import RunWriteError

    try:
        return run(config, launched_at=launched, hooks=hooks)
    except (GymConfigError, ConfigError) as exc:  # a bad Gym key, or data the run cannot use (preflight)
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
