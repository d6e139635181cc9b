"""Recovery benchmark: one module per measurement, shared helpers in ``common``.

``examples/bench_recovery.py`` is the entry point; ``tests/functional/test_bench_smoke.py``
runs the tiniest configuration of every measurement in-process.
"""
