"""What tests, the crash matrix and the benchmarks use to drive real runs from outside; not shipped.

- ``run_harness``: start ``python -m testkit.run_grpo`` in its own session, kill
  it on a condition, reap every process it started, read what it wrote.
- ``run_grpo``: the test entry of a run: the product's main with test hooks.
- ``crash_points``: ``CrashAt``, run hooks that SIGKILL the run at a phase.
- ``write_faults``: a storage writer that fails one write like a full disk (a run
  names it in ``checkpointing.storage_writer``; every process builds its own and hands it to its stores).

The wheel packages only ``gym_patches`` and ``nemo_rl``; product modules never
import this package (``tests/unit/test_no_test_hooks_in_product.py``).
"""
