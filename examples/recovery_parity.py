"""Recovery parity on your own config: the same run with and without faults must train on the same samples.

    python examples/recovery_parity.py --config examples/configs/grpo_workplace_two_replicas_turn.yaml
    python examples/recovery_parity.py --config my.yaml --faults kill,kill,term:replicas=1 grpo.max_num_steps=6

Runs the config with ``grpo.deterministic=true`` once without faults and once under ``--faults`` (by
default one of each kind: a Gym server, a replica and the generation worker lost in-run, a stopped
server, two whole-run SIGKILLs and a SIGTERM relaunched on another replica count), then compares, step by
step, the groups trained, every sample's token ids, masks, rewards (exact), logprobs and advantages
(tolerance), the metrics, the tool effects and the final weights. Prints the faults, one table and the
first difference; exit 0 on parity, 1 on a difference. ``--help`` lists the options; the logic is
``nemo_rl/parity/harness.py``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nemo_rl.parity.harness import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
