"""Gym side of the rollout-recovery patch set (upstream package: ``nemo_gym``).

Nothing in this package imports from ``nemo_rl``: Gym knows nothing of RL.
"""
