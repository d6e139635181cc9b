"""The points where a run lets an outside party act: ``RunHooks``, which by default does nothing.

The product passes no hooks (``RunHooks()``). Tests and the crash matrix pass
their own implementation (``testkit/crash_points.py``: SIGKILL the run the nth
time a phase is reached), so product modules call a method here instead of
reading a test-only variable.
"""

from __future__ import annotations

# Where the run calls ``reached(phase, scope)``; the scope of the snapshot phases is the trainer step.
PHASES: dict[str, str] = {
    "prepare": "a snapshot has Gym prepared, before anything is committed",
    "commit": "Gym has committed its records (staged: captured them at prepare), before the snapshot is published",
    "persist": "rollouts have resumed after a snapshot's pause and its files are not written (staged: Gym has "
               "not written its captured records); the previous snapshot must stay the newest valid",
    "publish": "the snapshot's temporary directory is fully written, before it is sealed and renamed into place",
    "restore": "Gym has restored the snapshot's episodes, before the ledger is applied",
    "train": "inside a training step: the trainer has consumed the batch, the step is not checkpointed yet",
    "refit": "the trained weights are about to go to generation (rollouts of later steps in flight in async mode)",
    "checkpointed": "a trainer checkpoint was just published, before any snapshot under it",
    "validate": "a validation rollout has finished, others of the same validation may still run",
    "watch": "the in-run recovery starts a watch of a part (scope: the part's name); an error raised here is "
             "a watch that failed",
}


class RunHooks:
    """What a run calls at its fixed points; this default does what the product does without hooks."""

    def reached(self, phase: str, scope: object = None) -> None:
        """The run reached ``phase`` (one of ``PHASES``); ``scope`` groups reaches (e.g. the trainer step)."""

    def on_restart_only_servers(self, error: Exception) -> None:
        """The restart-only check refused the Gym setup with ``error``; the product fails with it."""
        raise error
