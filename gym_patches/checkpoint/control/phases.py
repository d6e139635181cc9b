"""The phase machine of one participant, as data: which operation is admitted in which phase,
what each step moves to, fencing of finished checkpoint ids, and the replies a retry gets.

Phases: idle -> preparing -> prepared -> committed, and idle -> restored; any -> idle on resume or
lease expiry (``reopen``). An id that was resumed or whose lease expired is fenced: every later
call with it is ``stale_checkpoint``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Hashable

from gym_patches.checkpoint.errors import CheckpointError
from gym_patches.checkpoint.wire import Phase

RESUMED_IDS_KEPT = 64
STORED_RESULTS_KEPT = 256

NON_IDLE: frozenset[Phase] = frozenset({"preparing", "prepared", "committed", "restored"})

# operation -> the phases it is admitted in (resume: any; persist: not tied to a phase, it
# answers from the newest capture).
ADMITTED: dict[str, frozenset[Phase]] = {
    "prepare": frozenset({"idle", "preparing"}),
    "renew": NON_IDLE,
    "retire": frozenset({"idle", "restored"}),
    "commit": frozenset({"prepared", "committed"}),
    "forget": frozenset({"idle"}),
    "restore": frozenset({"idle"}),
}

# (phase, step) -> the phase it moves to; ``reopen`` moves any phase to idle.
MOVES: dict[tuple[Phase, str], Phase] = {
    ("idle", "close"): "preparing",  # prepare closed admission
    ("preparing", "ready"): "prepared",  # the participant reported ready (and captured, if asked)
    ("prepared", "commit"): "committed",  # the commit's manifest is published
    ("idle", "restore"): "restored",  # the records are installed
}

_HINTS = {"retire": "; resume first"}


class PhaseMachine:
    """Phase, active checkpoint id, fenced ids and stored replies. Not locked itself: the control
    plane calls it under its lock."""

    def __init__(self) -> None:
        self.phase: Phase = "idle"
        self.checkpoint_id: str | None = None
        self._fenced: OrderedDict[str, None] = OrderedDict()
        self._replies: OrderedDict[tuple[str, str], tuple[Hashable, dict[str, Any]]] = OrderedDict()

    # -- admission ---------------------------------------------------------
    def is_fenced(self, checkpoint_id: str) -> bool:
        return checkpoint_id in self._fenced

    def check_stale(self, checkpoint_id: str) -> None:
        if checkpoint_id in self._fenced:
            raise CheckpointError(f"checkpoint {checkpoint_id!r} was already resumed", code="stale_checkpoint")

    def admit(self, checkpoint_id: str, op: str) -> None:
        """Refuse ``op`` for ``checkpoint_id`` unless the table admits it now."""
        self.check_stale(checkpoint_id)
        if self.phase != "idle" and self.checkpoint_id != checkpoint_id:
            raise CheckpointError(
                f"{op} for {checkpoint_id!r} refused: checkpoint {self.checkpoint_id!r} is active",
                code="checkpoint_conflict",
            )
        allowed = ADMITTED[op]
        if self.phase not in allowed:
            raise CheckpointError(
                f"{op} needs phase {' or '.join(sorted(allowed))}, but phase is {self.phase}{_HINTS.get(op, '')}",
                code="invalid_phase",
            )

    def is_at(self, checkpoint_id: str, *phases: Phase) -> bool:
        return self.checkpoint_id == checkpoint_id and self.phase in phases

    # -- moves -------------------------------------------------------------
    def move(self, step: str, checkpoint_id: str) -> None:
        target = MOVES.get((self.phase, step))
        if target is None or (self.phase != "idle" and self.checkpoint_id != checkpoint_id):
            raise AssertionError(f"no move {step!r} from phase {self.phase} of {self.checkpoint_id!r} "
                                 f"for {checkpoint_id!r}")
        self.phase, self.checkpoint_id = target, checkpoint_id

    def reopen(self) -> None:
        self.phase, self.checkpoint_id = "idle", None

    def fence(self, checkpoint_id: str) -> None:
        """Spend ``checkpoint_id``: later calls with it are stale; its stored replies go."""
        self._fenced[checkpoint_id] = None
        self._fenced.move_to_end(checkpoint_id)
        while len(self._fenced) > RESUMED_IDS_KEPT:
            self._fenced.popitem(last=False)
        for key in [k for k in self._replies if k[0] == checkpoint_id]:
            del self._replies[key]

    # -- idempotent replies ------------------------------------------------
    def replay(self, checkpoint_id: str, op: str, args: Hashable) -> dict[str, Any] | None:
        """The stored reply of the same call, None if there is none; other arguments conflict."""
        entry = self._replies.get((checkpoint_id, op))
        if entry is None:
            return None
        stored_args, reply = entry
        if stored_args != args:
            raise CheckpointError(
                f"{op} for checkpoint {checkpoint_id!r} was already done with other arguments",
                code="checkpoint_conflict",
            )
        return reply

    def remember(self, checkpoint_id: str, op: str, args: Hashable, reply: dict[str, Any]) -> None:
        self._replies[(checkpoint_id, op)] = (args, reply)
        self._replies.move_to_end((checkpoint_id, op))
        while len(self._replies) > STORED_RESULTS_KEPT:
            self._replies.popitem(last=False)
