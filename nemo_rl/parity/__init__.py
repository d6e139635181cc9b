"""Recovery parity: a run under faults trains on exactly what the same run without faults trains on.

``trace`` is what a deterministic run records per step (``grpo.deterministic``); the harness
(``examples/recovery_parity.py``) runs a config twice, drives faults at the second run from outside by
signals (``faults``, ``processes``, ``launch``), and compares the two runs' records (``compare``);
docs/design.md §5.13.
"""
