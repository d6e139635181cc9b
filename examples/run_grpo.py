"""GRPO with turn-level rollout recovery: ``python examples/run_grpo.py [--config X.yaml] [--check] [key=value ...]``.

With no arguments it runs the embedded default: local Ray, Gym servers on
loopback, the tiny CPU policy, the Workplace setup with turn recovery. Running
the same command again after a crash resumes from the newest checkpoint.
``--help`` lists the shipped configs and the recovery keys.

The run itself is ``nemo_rl.cli.run_grpo.main`` (``python -m nemo_rl.cli.run_grpo``
is the same command); this file only puts the repository on ``sys.path``, so it
works from any directory without an install. Relative paths follow one rule
either way: the current directory first, then the repository root
(``nemo_rl/cli/preflight.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nemo_rl.cli.run_grpo import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
