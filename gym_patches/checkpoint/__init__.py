"""Checkpoint protocol for Gym servers (upstream: ``nemo_gym._checkpoint``)."""
