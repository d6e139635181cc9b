"""Small shared helpers of the RL side (on-disk snapshot layout)."""
