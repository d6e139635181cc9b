"""The rollout-recovery ledger: prompt group -> siblings -> attempts, and its transitions.

The ledger is the RL side's single record of which rollout attempts exist,
where they run and which are sealed. It is pure bookkeeping (no Ray, no HTTP),
so a snapshot of it plus the data plane is a consistent picture
(docs/design.md §5.3). This module holds the mutable ledger and the checked
moves between states (reserve, dispatch, refuse, seal, fail, train, compact)
and its persistence; the records it moves live in ``schema``, the restart rules in
``restart``, and what a snapshot asks of Gym in the snapshot planner.
"""

from __future__ import annotations

from typing import Any, Iterator, NamedTuple

from immutables import Map
from pydantic import ValidationError

from gym_patches.checkpoint.identity import EpisodeId
from nemo_rl.experience.rollout_recovery.levels import RecoveryTargetLevel
from nemo_rl.experience.rollout_recovery.restart import (
    RestartSummary,
    RestoredEpisode,
    apply_recovery_rules,
    apply_restart_rules,
)
from nemo_rl.experience.rollout_recovery.schema import (
    LIVE_STATUSES,
    LedgerError,
    LedgerState,
    PositionRange,
    PromptGroupRecoveryRecord,
    PromptGroupStatus,
    RolloutAttemptRecord,
    RolloutAttemptStatus,
    RolloutRetriesExhausted,
    RolloutSiblingRecord,
    position_in,
    with_position,
)

DEFAULT_MAX_ATTEMPTS_PER_SIBLING = 3


class DispatchRequest(NamedTuple):
    """An attempt to send to Gym; ``gym_instance_id`` is set when it must go back
    to the replica that saved it."""

    group_id: str
    generation_index: int
    rollout_id: str
    gym_instance_id: str | None


class RolloutRecoveryLedger:
    """Mutable ledger; every error names the rollout id or group id involved."""

    def __init__(self, max_attempts_per_sibling: int = DEFAULT_MAX_ATTEMPTS_PER_SIBLING):
        if max_attempts_per_sibling < 1:
            raise ValueError("max_attempts_per_sibling must be >= 1")
        self.max_attempts_per_sibling = max_attempts_per_sibling
        self.groups: dict[str, PromptGroupRecoveryRecord] = {}
        # Positions of every group trained this run, as merged [lo, hi) ranges (see LedgerState).
        self.trained_positions: list[PositionRange] = []
        self._by_base: dict[str, tuple[str, int, int]] = {}  # base id -> (group, g, attempt idx)
        self._by_position: dict[int, str] = {}  # dataloader position -> group id in the ledger
        self._views = _PauseViews()  # what a snapshot's pause reads, kept up to date per changed group

    @property
    def trained_count(self) -> int:
        """How many groups this run has trained (compacted ones included)."""
        return sum(hi - lo for lo, hi in self.trained_positions)

    def is_trained_position(self, position: int) -> bool:
        return position_in(self.trained_positions, position)

    # ----- lifecycle -------------------------------------------------------
    def reserve_group(
        self,
        group_id: str,
        prompt_id: str,
        prompt_index: int,
        task_source: str | None,
        agent_name: str | None,
        restore_level: RecoveryTargetLevel | str,
        num_generations: int,
        target_step: int,
        *,
        position: int,
    ) -> PromptGroupRecoveryRecord:
        """Record a new prompt group with one reserved attempt per generation.

        ``position`` is the dataloader position it takes; one already trained
        or held by another group is refused, so no prompt is trained twice.
        """
        if group_id in self.groups:
            raise LedgerError(f"group {group_id} is already in the ledger")
        if self.is_trained_position(position):
            raise LedgerError(f"group {group_id}: dataloader position {position} was already trained")
        if position in self._by_position:
            raise LedgerError(
                f"group {group_id}: dataloader position {position} is held by group {self._by_position[position]}"
            )
        if num_generations < 1:
            raise LedgerError(f"group {group_id}: num_generations must be >= 1")
        group = PromptGroupRecoveryRecord(
            group_id=group_id,
            prompt_id=prompt_id,
            prompt_index=prompt_index,
            task_source=task_source,
            agent_name=agent_name,
            restore_level=RecoveryTargetLevel(restore_level),
            expected_generations=num_generations,
            target_step=target_step,
            position=position,
            siblings=[
                RolloutSiblingRecord(generation_index=g, attempts=[RolloutAttemptRecord()])
                for g in range(num_generations)
            ],
        )
        # Validates the ids against Gym's rollout-id rules before anything is stored.
        for g in range(num_generations):
            group.siblings[g].current_attempt.episode(group_id, g)
        self.groups[group_id] = group
        self._index_group(group)
        self._views.touch(group_id, added=True)
        return group

    def reserved_attempts(self) -> list[DispatchRequest]:
        """Every current attempt waiting for dispatch, in reservation order."""
        out = []
        for group in self.groups.values():
            if group.status is not PromptGroupStatus.GENERATING:
                continue
            for sibling in group.siblings:
                attempt = sibling.current_attempt
                if attempt.status is RolloutAttemptStatus.RESERVED:
                    out.append(
                        DispatchRequest(
                            group.group_id,
                            sibling.generation_index,
                            attempt.rollout_id(group.group_id, sibling.generation_index),
                            attempt.gym_instance_id,
                        )
                    )
        return out

    def mark_dispatched(self, rollout_id: str, gym_instance_id: str, weight_version: int | None = None) -> None:
        """``weight_version``: the version serving now; the group's first dispatch records it."""
        group, sibling, attempt = self._current(rollout_id)
        if attempt.status is not RolloutAttemptStatus.RESERVED:
            raise LedgerError(
                f"rollout {rollout_id} is {attempt.status.value}, only a reserved attempt "
                "can be dispatched"
            )
        if attempt.gym_attempt > 0 and attempt.gym_instance_id != gym_instance_id:
            raise LedgerError(
                f"rollout {rollout_id} was restored by Gym instance {attempt.gym_instance_id} "
                f"and must return to it, not to {gym_instance_id}"
            )
        self.replace_current(
            group,
            sibling,
            attempt.model_copy(
                update={"status": RolloutAttemptStatus.DISPATCHED, "gym_instance_id": gym_instance_id}
            ),
        )
        if group.start_weight_version is None and weight_version is not None:
            group.start_weight_version = int(weight_version)

    def mark_refused(self, rollout_id: str, max_refusals: int) -> int:
        """Gym refused a dispatched attempt (closed for a checkpoint): it is reserved again.

        A fresh attempt forgets its replica (Gym never had it); a restored one
        keeps it (its saved session waits there). Returns the refusal count;
        past ``max_refusals`` it raises, naming the rollout.
        """
        group, sibling, attempt = self._current(rollout_id)
        if attempt.status is not RolloutAttemptStatus.DISPATCHED:
            raise LedgerError(f"cannot mark rollout {rollout_id} refused: it is {attempt.status.value}")
        refusals = attempt.refusals + 1
        if refusals > max_refusals:
            raise LedgerError(
                f"rollout {rollout_id} was refused by Gym {refusals} times (the limit is {max_refusals}); "
                "Gym keeps its admission closed"
            )
        self.replace_current(
            group,
            sibling,
            attempt.model_copy(update={
                "status": RolloutAttemptStatus.RESERVED,
                "refusals": refusals,
                "gym_instance_id": attempt.gym_instance_id if attempt.gym_attempt > 0 else None,
            }),
        )
        return refusals

    def refused_waiting(self) -> list[str]:
        """Turn-level attempts Gym refused that wait for redispatch (never admitted); kept up to date
        per changed group, as ``turn_level_held`` (a snapshot counts them in the pause)."""
        return self._views.refused(self)

    def mark_sealed(self, rollout_id: str, reward: float) -> PromptGroupRecoveryRecord:
        """Seal a dispatched attempt; the group becomes complete with its last sibling."""
        group, sibling, attempt = self._current(rollout_id)
        if attempt.status is not RolloutAttemptStatus.DISPATCHED:
            raise LedgerError(
                f"cannot seal rollout {rollout_id}: it is {attempt.status.value}, not dispatched"
            )
        self.replace_current(
            group,
            sibling,
            attempt.model_copy(update={"status": RolloutAttemptStatus.SEALED, "reward": float(reward)}),
        )
        if group.all_sealed():
            group.status = PromptGroupStatus.COMPLETE
        return group

    def mark_failed(self, rollout_id: str) -> str:
        """Fail a live attempt and reserve a retry from the prompt; returns its id."""
        group, sibling, attempt = self._current(rollout_id)
        if attempt.status not in LIVE_STATUSES:
            raise LedgerError(
                f"cannot fail rollout {rollout_id}: it is {attempt.status.value}"
            )
        self.replace_current(
            group, sibling, attempt.model_copy(update={"status": RolloutAttemptStatus.FAILED})
        )
        failures = sibling.failure_count()
        if failures >= self.max_attempts_per_sibling:
            raise RolloutRetriesExhausted(rollout_id, failures)
        return self.append_attempt(group, sibling)

    def complete_groups(self) -> list[PromptGroupRecoveryRecord]:
        """Groups whose siblings are all sealed and which are not trained yet."""
        return [g for g in self.groups.values() if g.status is PromptGroupStatus.COMPLETE]

    def mark_group_trained(self, group_id: str) -> None:
        """Record a complete group as trained; refused if it (or its position) was trained already."""
        group = self._group(group_id)
        if group.status is PromptGroupStatus.TRAINED or self.is_trained_position(group.position):
            raise LedgerError(f"group {group_id} (position {group.position}) was already trained")
        if group.status is not PromptGroupStatus.COMPLETE:
            raise LedgerError(f"group {group_id} is {group.status.value}, not complete")
        group.status = PromptGroupStatus.TRAINED
        self._views.touch(group_id)
        self.trained_positions = with_position(self.trained_positions, group.position)

    def checkpoint_state(self, trained_now: list[str]) -> tuple[dict, int | None]:
        """What a trainer checkpoint keeps of the ledger, without changing it.

        The positions trained so far plus ``trained_now`` (groups the step being saved trained, not
        yet marked: until the checkpoint is published a snapshot must still see them complete), and
        no group record: without a rollout snapshot, whatever was in flight restarts from its prompt.
        Also returns the lowest position still untrained, where a trainer-only restore resumes the
        dataloader (None: nothing in flight).
        """
        positions = list(self.trained_positions)
        now = set(trained_now)
        for group_id in trained_now:
            group = self._group(group_id)
            if group.status is not PromptGroupStatus.COMPLETE:
                raise LedgerError(f"group {group_id} is {group.status.value}, not complete: it cannot be trained")
            positions = with_position(positions, group.position)
        untrained = [g.position for gid, g in self.groups.items()
                     if gid not in now and g.status is not PromptGroupStatus.TRAINED]
        state = LedgerState(max_attempts_per_sibling=self.max_attempts_per_sibling, groups=[],
                            trained_positions=positions, trained_count=sum(hi - lo for lo, hi in positions))
        return state.model_dump(mode="json"), min(untrained, default=None)

    def adopt_trained(self, positions: list[PositionRange]) -> tuple[list[str], list[str]]:
        """Take ``positions`` (a newer trainer checkpoint's) as trained: the groups at them leave the
        ledger whatever their state; returns their ids and their Gym rollout ids (every attempt).

        A rollout snapshot may be older than the trainer step it is restored with (taken under an
        earlier anchor): what that step trained is done, the rest of the snapshot continues.
        """
        merged: list[PositionRange] = []
        for lo, hi in sorted([*self.trained_positions, *(tuple(r) for r in positions)]):
            if merged and lo <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            else:
                merged.append((lo, hi))
        dropped = [gid for gid, g in self.groups.items() if position_in(merged, g.position)]
        self.trained_positions = merged
        return dropped, self._drop_records(dropped)

    def is_held_position(self, position: int) -> bool:
        """Whether ``position`` is trained or reserved by a group in the ledger (not to be reserved again)."""
        return position in self._by_position or self.is_trained_position(position)

    def compact_trained(self, group_ids) -> list[str]:
        """Drop the records of trained groups (their positions stay in ``trained_positions``).

        Returns the Gym rollout ids of every attempt they had, for Gym to forget.
        Keeps the ledger, and every snapshot of it, as large as the work in flight.
        """
        for group_id in group_ids:
            group = self._group(group_id)
            if group.status is not PromptGroupStatus.TRAINED:
                raise LedgerError(f"group {group_id} is {group.status.value}; only trained groups are compacted")
        return self._drop_records(group_ids)

    def _drop_records(self, group_ids) -> list[str]:
        rollout_ids = []
        for group_id in group_ids:
            group = self._group(group_id)
            for sibling in group.siblings:
                for attempt in sibling.attempts:
                    base = attempt.base_rollout_id(group_id, sibling.generation_index)
                    rollout_ids.append(base)
                    self._by_base.pop(base, None)
            self._by_position.pop(group.position, None)
            del self.groups[group_id]
            self._views.touch(group_id)
        return rollout_ids

    def attempt_status(self, rollout_id: str) -> RolloutAttemptStatus | None:
        """Status of a current attempt in a generating group; None if the id is
        unknown, superseded, or its group is already complete."""
        try:
            _, _, attempt = self._current(rollout_id)
        except LedgerError:
            return None
        return attempt.status

    def sealed_rollout_ids(self) -> set[str]:
        """Capture keys of every sealed current attempt (what the data plane must hold)."""
        return {
            g.rollout_id(s.generation_index)
            for g in self.groups.values()
            if g.status is not PromptGroupStatus.TRAINED
            for s in g.siblings
            if s.current_attempt.status is RolloutAttemptStatus.SEALED
        }

    # ----- what Gym holds (the snapshot pause's inventory reads it) ----------
    def turn_level_held(self) -> dict[str, Map]:
        """``turn_level_live`` as instance -> capture key -> agent name, kept up to date per changed
        group: a snapshot reads it in the pause at a cost that grows with what changed since the
        last read, not with the rollouts in flight (docs/design.md §5.4). Each instance's map is
        persistent (``immutables.Map``): a snapshot keeps a reference as its copy, which later changes
        to the ledger leave as it was. Only the dict around them is the ledger's own."""
        return self._views.held(self)

    def turn_level_live(self) -> Iterator[tuple[PromptGroupRecoveryRecord, int, RolloutAttemptRecord]]:
        """``(group, generation_index, attempt)`` for every current attempt Gym holds at turn level.

        Dispatched attempts, and reserved ones after a Gym restore (their saved
        session waits on that replica), in generating groups whose restore level
        needs Gym saves: what a snapshot asks Gym to commit. One pass, nothing built.
        """
        generating, dispatched, reserved = (PromptGroupStatus.GENERATING, RolloutAttemptStatus.DISPATCHED,
                                            RolloutAttemptStatus.RESERVED)  # locals: this runs in the pause
        for group in self.groups.values():
            if group.status is not generating or not group.restore_level.requires_gym_checkpoint:
                continue
            for sibling in group.siblings:
                attempt = sibling.attempts[-1]  # the current attempt
                status = attempt.status
                if status is dispatched or (status is reserved and attempt.gym_attempt > 0):
                    yield group, sibling.generation_index, attempt

    # ----- restart ----------------------------------------------------------
    def bring_back(self, restored: set[RestoredEpisode] | None = None, relocated: dict[str, str] | None = None,
                   *, lost: list[str] | None = None) -> RestartSummary:
        """The one entry point by which rollouts come back after a crash or a loss (``restart``).

        ``lost`` None (a relaunch, docs/design.md §5.5): every generating group's restore level is applied.
        ``lost`` (an in-run recovery, §5.12): only those capture keys (``live_on`` of the lost replica)
        change; every other rollout keeps running, and no failure is counted.

        ``restored`` holds ``(instance_id, base rollout_id, attempt)`` for each episode Gym installed, with
        the attempt Gym gave it (the saved attempt + 1): attempt numbers are Gym's everywhere, the ledger
        never re-derives them. ``relocated`` (base rollout id -> replica): episodes Gym installed on another
        replica than the one they ran on; the continued attempt is pinned there. The ledger changes only if
        every restored triple is consumed; otherwise ValueError names them and nothing changed."""
        if lost is not None:
            siblings = []
            for rollout_id in lost:
                group, sibling, _ = self._current(rollout_id)
                siblings.append((group, sibling))
            return apply_recovery_rules(self, siblings, restored or set(), relocated)
        staged = RolloutRecoveryLedger(self.max_attempts_per_sibling)
        staged.groups = {gid: g.model_copy(deep=True) for gid, g in self.groups.items()}
        staged.trained_positions = list(self.trained_positions)
        staged._reindex()
        summary = apply_restart_rules(staged, restored, relocated)
        self.groups = staged.groups
        self._reindex()
        return summary

    def live_on(self, gym_instance_id: str) -> list[str]:
        """Capture keys of the current attempts Gym holds on one replica: dispatched there, or restored
        there and waiting for dispatch. What a recovery of that replica takes over (docs/design.md §5.12)."""
        out = []
        for group in self.groups.values():
            if group.status is not PromptGroupStatus.GENERATING:
                continue
            for sibling in group.siblings:
                attempt = sibling.attempts[-1]
                if attempt.gym_instance_id != gym_instance_id:
                    continue
                if attempt.status is RolloutAttemptStatus.DISPATCHED or (
                        attempt.status is RolloutAttemptStatus.RESERVED and attempt.gym_attempt > 0):
                    out.append(attempt.rollout_id(group.group_id, sibling.generation_index))
        return out

    # ----- persistence -----------------------------------------------------
    def _state(self) -> LedgerState:
        return LedgerState(
            max_attempts_per_sibling=self.max_attempts_per_sibling,
            groups=list(self.groups.values()),
            trained_positions=list(self.trained_positions),
            trained_count=self.trained_count,
        )

    def state_dict(self) -> dict:
        """Pure-JSON state (enums as strings)."""
        return self._state().model_dump(mode="json")

    def state_json_parts(self) -> "LedgerJsonParts":
        """``state_json`` not yet joined: each group's bytes by reference, so a snapshot's pause takes
        them at a cost that follows what changed; ``encode`` joins them after rollouts resume."""
        return self._views.state_json(self)

    def refresh_pause_views(self) -> None:
        """Bring ``turn_level_held``, ``refused_waiting`` and ``state_json_parts`` up to date now. The
        snapshotter calls it before each attempt, gate open: the pause then recomputes only the groups
        that changed during the prepare, not those that changed since the last snapshot (docs/design.md
        §5.4)."""
        self._views.refresh(self)

    def state_json(self) -> bytes:
        """``state_dict`` as JSON bytes, as pydantic-core writes them, with each group's part kept from
        the last call unless the group changed since (a snapshot takes this while rollouts are held:
        its cost follows what changed, not the ledger's size). Not validated here: the transitions keep
        the ledger consistent, and the snapshot checks these bytes after rollouts resume
        (``check_state_json``), before anything is sealed."""
        return self._views.state_json(self).encode()

    @staticmethod
    def check_state_json(data: bytes) -> None:
        """Raise ``LedgerError`` naming the problem if ``state_json`` bytes are not a consistent ledger."""
        try:
            LedgerState.model_validate_json(data)
        except ValidationError as exc:
            raise LedgerError(f"ledger state is inconsistent: {exc.errors()[0]['msg']}") from None

    def load_state_dict(self, state: dict) -> None:
        """Replace the ledger with a validated state; unknown fields are rejected."""
        parsed = LedgerState.model_validate(state)
        self.max_attempts_per_sibling = parsed.max_attempts_per_sibling
        self.groups = {g.group_id: g for g in parsed.groups}
        self.trained_positions = [tuple(r) for r in parsed.trained_positions]
        self._reindex()

    @classmethod
    def from_state_dict(cls, state: dict) -> "RolloutRecoveryLedger":
        ledger = cls()
        ledger.load_state_dict(state)
        return ledger

    # ----- internals -------------------------------------------------------
    def _group(self, group_id: str) -> PromptGroupRecoveryRecord:
        try:
            return self.groups[group_id]
        except KeyError:
            raise LedgerError(
                f"unknown group {group_id}: not in the ledger (never reserved, or trained and compacted)"
            ) from None

    def _current(self, rollout_id: str):
        """(group, sibling, attempt) for the capture key of a current attempt."""
        try:
            episode = EpisodeId.from_capture_key(rollout_id)
        except ValueError:
            raise LedgerError(f"malformed rollout id {rollout_id!r}") from None
        where = self._by_base.get(episode.rollout_id)
        if where is None:
            raise LedgerError(f"unknown rollout {rollout_id}")
        group_id, g, idx = where
        group = self.groups[group_id]
        sibling = group.siblings[g]
        attempt = sibling.attempts[idx]
        if idx != len(sibling.attempts) - 1:
            raise LedgerError(
                f"rollout {rollout_id} is not the current attempt of {group_id} g{g} "
                f"(it is {attempt.status.value})"
            )
        if attempt.gym_attempt != episode.attempt:
            raise LedgerError(
                f"rollout {rollout_id} is stale: the current Gym attempt is "
                f"{attempt.rollout_id(group_id, g)}"
            )
        if group.status is not PromptGroupStatus.GENERATING:
            raise LedgerError(f"rollout {rollout_id}: group {group_id} is {group.status.value}")
        return group, sibling, attempt

    # ----- record edits (the transitions' and the restart rules') -----------
    def replace_current(self, group: PromptGroupRecoveryRecord, sibling: RolloutSiblingRecord,
                        attempt: RolloutAttemptRecord) -> None:
        """Swap in the sibling's new current attempt (no checks: the transitions and ``restart`` check)."""
        sibling.attempts = [*sibling.attempts[:-1], attempt]
        self._views.touch(group.group_id)

    def append_attempt(self, group: PromptGroupRecoveryRecord, sibling: RolloutSiblingRecord) -> str:
        """Reserve a fresh attempt for the sibling and index it; returns its capture key."""
        attempt = RolloutAttemptRecord()
        sibling.attempts = [*sibling.attempts, attempt]
        self._views.touch(group.group_id)
        g = sibling.generation_index
        self._by_base[attempt.base_rollout_id(group.group_id, g)] = (
            group.group_id,
            g,
            len(sibling.attempts) - 1,
        )
        return attempt.rollout_id(group.group_id, g)

    def _index_group(self, group: PromptGroupRecoveryRecord) -> None:
        self._by_position[group.position] = group.group_id
        for sibling in group.siblings:
            for idx, attempt in enumerate(sibling.attempts):
                base = attempt.base_rollout_id(group.group_id, sibling.generation_index)
                self._by_base[base] = (group.group_id, sibling.generation_index, idx)

    def _reindex(self) -> None:
        self._by_base = {}
        self._by_position = {}
        for group in self.groups.values():
            self._index_group(group)
        self._views = _PauseViews()  # every group replaced: computed afresh when next read


class _PauseViews:
    """What a snapshot's pause reads of the ledger, derived per group and recomputed only for the groups
    the ledger's transitions touched since the last read (docs/design.md §5.4): each group's JSON and
    the turn-level rollouts Gym holds for it. Every edit of a group record goes through the ledger,
    which touches the group; group records replaced wholesale (load, restart) start new views, whose
    first read computes every group."""

    def __init__(self) -> None:
        # group id -> (its place in ``ledger.groups``, its part of ``state_json``); persistent: a snapshot keeps
        # a reference. The places are in the order groups were first touched, which is their order in the
        # ledger (a group is touched as it is reserved; groups replaced wholesale start new views).
        self._json: Map = Map()
        self._json_next = 0
        self._json_dirty: dict[str, None] | None = None  # None: every group; else in the order first touched
        self._json_added: set[str] = set()  # groups put into the ledger since the last update: a new place each
        self._held: dict[str, Map] = {}  # instance -> capture key -> agent (persistent: readers keep references)
        self._held_of: dict[str, list[tuple[str, str, str | None]]] = {}  # group -> its entries in ``_held``
        self._refused_of: dict[str, list[str]] = {}  # group -> its refused attempts waiting for redispatch
        self._held_dirty: set[str] | None = None

    def touch(self, group_id: str, added: bool = False) -> None:
        if self._json_dirty is not None:
            if added:  # it goes last in the ledger: last among the changes, with a new place (an id may come back)
                self._json_dirty.pop(group_id, None)
                self._json_added.add(group_id)
            self._json_dirty.setdefault(group_id)
        if self._held_dirty is not None:
            self._held_dirty.add(group_id)

    def held(self, ledger: "RolloutRecoveryLedger") -> dict[str, Map]:
        self._update_turn_level(ledger)
        return self._held

    def refused(self, ledger: "RolloutRecoveryLedger") -> list[str]:
        self._update_turn_level(ledger)
        return [key for keys in self._refused_of.values() for key in keys]

    def _update_turn_level(self, ledger: "RolloutRecoveryLedger") -> None:
        changed, self._held_dirty = (list(ledger.groups) if self._held_dirty is None else self._held_dirty), set()
        edits: dict[str, Any] = {}  # instance -> its map's mutation, finished once below

        def edit(iid: str):
            if iid not in edits:
                edits[iid] = self._held.get(iid, _NO_KEYS).mutate()
            return edits[iid]

        for group_id in changed:
            for iid, key, _ in self._held_of.pop(group_id, ()):
                del edit(iid)[key]
            self._refused_of.pop(group_id, None)
            group = ledger.groups.get(group_id)
            if group is None:
                continue
            entries, refused = _turn_level_entries(group)
            if entries:
                self._held_of[group_id] = entries
                for iid, key, agent in entries:
                    edit(iid)[key] = agent
            if refused:
                self._refused_of[group_id] = refused
        for iid, mutation in edits.items():
            self._held[iid] = mutation.finish()

    def refresh(self, ledger: "RolloutRecoveryLedger") -> None:
        self._update_turn_level(ledger)
        self._update_json(ledger)

    def _update_json(self, ledger: "RolloutRecoveryLedger") -> None:
        changed, self._json_dirty = (list(ledger.groups) if self._json_dirty is None else self._json_dirty), {}
        added, self._json_added = self._json_added, set()
        if not changed:
            return
        serialize = PromptGroupRecoveryRecord.__pydantic_serializer__.to_json
        with self._json.mutate() as edit:
            for group_id in changed:
                group = ledger.groups.get(group_id)
                if group is None:
                    edit.pop(group_id, None)
                    continue
                kept = None if group_id in added else edit.get(group_id)
                if kept is None:
                    kept, self._json_next = (self._json_next, b""), self._json_next + 1
                edit[group_id] = (kept[0], serialize(group))
            self._json = edit.finish()

    def state_json(self, ledger: "RolloutRecoveryLedger") -> "LedgerJsonParts":
        self._update_json(ledger)
        frame = LedgerState.model_construct(max_attempts_per_sibling=ledger.max_attempts_per_sibling, groups=[],
                                            trained_positions=list(ledger.trained_positions),
                                            trained_count=ledger.trained_count)
        head, tail = frame.__pydantic_serializer__.to_json(frame).split(_EMPTY_GROUPS, 1)
        return LedgerJsonParts(head, self._json, tail)


class LedgerJsonParts(NamedTuple):
    """``state_json`` in parts: the frame around the groups, and every group's JSON with its place in the
    ledger (a persistent map, by reference: taken in a snapshot's pause at no cost that grows with the
    ledger; ``encode`` orders and joins them after resume)."""

    head: bytes
    groups: Map  # group id -> (place, JSON)
    tail: bytes

    def encode(self) -> bytes:
        parts = [part for _, part in sorted(self.groups.values(), key=_place)]
        return b"".join((self.head, b'"groups":[', b",".join(parts), b"]", self.tail))


def _place(entry: tuple[int, bytes]) -> int:
    return entry[0]


_EMPTY_GROUPS = b'"groups":[]'
_NO_KEYS: Map = Map()


def _turn_level_entries(group: PromptGroupRecoveryRecord) -> tuple[list[tuple[str, str, str | None]], list[str]]:
    """Of the group's current attempts: ``(instance, capture key, agent)`` of each Gym holds at turn level
    (the rule of ``RolloutRecoveryLedger.turn_level_live``), and the capture keys of those Gym refused
    that wait for redispatch, never admitted (``refused_waiting``)."""
    if group.status is not PromptGroupStatus.GENERATING or not group.restore_level.requires_gym_checkpoint:
        return [], []
    held, refused = [], []
    for sibling in group.siblings:
        attempt = sibling.attempts[-1]
        status = attempt.status
        if status is RolloutAttemptStatus.DISPATCHED or (status is RolloutAttemptStatus.RESERVED
                                                         and attempt.gym_attempt > 0):
            held.append((attempt.gym_instance_id, attempt.rollout_id(group.group_id, sibling.generation_index),
                         group.agent_name))
        elif status is RolloutAttemptStatus.RESERVED and attempt.refusals > 0:
            refused.append(attempt.rollout_id(group.group_id, sibling.generation_index))
    return held, refused
