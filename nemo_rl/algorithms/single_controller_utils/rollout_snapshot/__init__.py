"""Rollout snapshots: save and restore of rollouts in flight, one component with DCP-like roles.

Where each role lives (docs/design.md §5.4.1, "The parts"):

- ``planner.py``: the snapshot's bookkeeping, pure functions of the ledger and
  Gym's answers (what each Gym instance is asked to save, the ownership check,
  the counts), and the ledger's Gym inventory;
- ``stagers.py``: one stager per mode (``staged``, ``blocking``,
  ``ledger_only``), chosen once at setup, each with ``hold`` / ``stage`` /
  ``write``;
- ``generation_cut_scope.py``: which rollouts' model calls a prefix-level
  snapshot's generation cut takes (docs/design.md §5.10);
- ``snapshotter.py``: one attempt, in order: gate -> prepare -> stage ->
  resume -> write -> publish;
- ``store.py``: ``RunStore``, the layout of the checkpoint directory (begin,
  publish and abort a snapshot, save and prune trainer steps, select what to
  restore), and the snapshot's files (``ControllerState``,
  ``GymCheckpointIndex``), each read beside its write;
- ``restore.py``: select, read, Gym restore, restart rules -> ``RestoredState``;
- ``reshard.py``: elastic restore, which running replica installs each saved
  episode when the replica count changed (docs/design.md §5.7);
- ``outcome.py``: an attempt's record and how failures are classified;
- ``inputs.py``: what a snapshot may read from the controller.

The Gym side of every call goes through ``GymCheckpointCoordinator``
(``single_controller_utils/gym_coordinator.py``).
"""

from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.inputs import SnapshotInputs
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.outcome import SnapshotOutcome, SnapshotSuperseded
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.restore import (
    RestoredState,
    RestoreLookup,
    RunRestorer,
    find_restore_point,
)
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.snapshotter import RolloutSnapshotter
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.store import (
    CONTROLLER_STATE_FILE,
    GYM_CHECKPOINT_FILE,
    ControllerState,
    GymCheckpointIndex,
)

__all__ = [
    "CONTROLLER_STATE_FILE",
    "GYM_CHECKPOINT_FILE",
    "ControllerState",
    "GymCheckpointIndex",
    "RestoreLookup",
    "RestoredState",
    "RolloutSnapshotter",
    "RunRestorer",
    "SnapshotInputs",
    "SnapshotOutcome",
    "SnapshotSuperseded",
    "find_restore_point",
]
