"""GRPO with turn-level rollout recovery: ``python examples/run_grpo.py [--config X.yaml] [key=value ...]``.

With no arguments it runs the embedded default: local Ray, Gym servers on
loopback, the tiny CPU policy, the Workplace setup with turn recovery. Running
the same command again after a crash resumes from the newest checkpoint.

The run itself is ``nemo_rl.cli.run_grpo.main``; this command makes it work from
any directory: the repository is put on ``sys.path`` and made the working
directory (config paths such as ``examples/data/...`` are relative to it), unless
``NEMO_RL_CHDIR_REPO=0``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
os.chdir(REPO_ROOT) if os.environ.get("NEMO_RL_CHDIR_REPO", "1") == "1" else None

from nemo_rl.cli.run_grpo import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
