"""Command-line entry points of the product (``examples/run_grpo.py`` is the user command in front of them)."""
