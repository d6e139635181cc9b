"""RL side of the rollout-recovery patch set (upstream package: ``nemo_rl``)."""
