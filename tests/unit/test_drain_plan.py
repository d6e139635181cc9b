"""The snapshot drain waits only for replies that may be on the wire (docs/design.md §5.4).

Inside the pause, a turn-level rollout the ledger dispatched to an instance that Gym neither exported
nor reported unsaved either ended in Gym a moment ago (its reply is on its way: worth a short wait,
or its finished work would be restarted) or has not reached the agent yet (its ``/run`` is still
queued: nothing it did can be lost, and waiting for it only lengthens the pause, by the whole grace
during a step's burst of ``/run`` calls). The agents say which runs they answered lately; an instance
whose agents do not say has every such rollout waited for, as before.

The pause decides what to wait for from what the agents answered, without a pass over the scope
(``drain_wait``); what Gym did not save is split after resume (``unstarted_after_drain``).
"""

from __future__ import annotations

from gym_patches.checkpoint.coordination import PrepareResult
from gym_patches.checkpoint.wire import PrepareReply, PrepareReport
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.stagers import drain_wait, unstarted_after_drain


def keys_of(scope: dict[str, dict[str, str]]) -> dict[str, set[str]]:
    return {iid: set(agents) for iid, agents in scope.items()}  # as ``SnapshotPlan.scope_keys``


def reply(ended: list[str] | None) -> PrepareReply:
    return PrepareReply(phase="prepared", report=PrepareReport(ready=True, ended=ended))


class Exported(dict):
    """Instance -> exported keys, recording which instances the pause asked for (a pass over the scope)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.asked: list[str] = []

    def of(self, iid: str) -> set[str]:
        self.asked.append(iid)
        return self[iid]


def test_only_rollouts_the_agents_answered_lately_are_waited_for():
    scope = {"s/replica-0": {"held": "a", "ended": "a", "queued": "a"}, "s/replica-1": {"q2": "a", "e2": "a"}}
    exported = Exported({"s/replica-0": {"held"}, "s/replica-1": set()})
    ended = {"s/replica-0": {"ended", "unrelated"}, "s/replica-1": {"e2"}}
    wait = drain_wait(scope, ended, exported.of)
    assert wait == {"ended": "s/replica-0", "e2": "s/replica-1"}
    assert exported.asked == []  # nothing over the scope in the pause when the agents say what they answered
    assert unstarted_after_drain(keys_of(scope), exported, wait, {}, {}) == {"s/replica-0": {"queued"}, "s/replica-1": {"q2"}}


def test_a_waited_rollout_that_did_not_finish_restarts_unless_gym_saved_it():
    scope = {"i": {"held": "a", "late": "a", "queued": "a", "captured_and_ended": "a"}}
    exported = {"i": {"held", "captured_and_ended"}}
    wait = drain_wait(scope, {"i": {"late", "captured_and_ended"}}, exported.__getitem__)
    assert wait == {"late": "i", "captured_and_ended": "i"}  # answered lately: its reply is on the wire
    # neither sealed nor failed within the grace: the captured one continues at its turn, the other restarts
    out = unstarted_after_drain(keys_of(scope), exported, wait, unfinished=dict(wait), reported={"i": {"arrived_closed"}})
    assert out == {"i": {"late", "queued", "arrived_closed"}}
    # the late one sealed in the drain: only the queued one (and the reported one) restarts
    assert unstarted_after_drain(keys_of(scope), exported, wait, {}, {"i": {"arrived_closed"}}) == {"i": {"queued", "arrived_closed"}}


def test_an_instance_whose_agents_do_not_say_has_every_missing_rollout_waited_for():
    scope = {"old": {"x": "a", "y": "a"}, "new": {"z": "a"}}
    exported = Exported({"old": {"x"}, "new": set()})
    wait = drain_wait(scope, {"old": None, "new": set()}, exported.of)
    assert wait == {"y": "old"} and exported.asked == ["old"]
    assert unstarted_after_drain(keys_of(scope), exported, wait, {}, {}) == {"old": set(), "new": {"z"}}
    assert unstarted_after_drain(keys_of(scope), exported, wait, {"y": "old"}, {}) == {"old": {"y"}, "new": {"z"}}


def test_the_prepare_result_unions_its_agents_ended_runs_and_says_none_if_one_agent_did_not():
    result = PrepareResult(prepared=True)
    result.replies = {"agent_a": reply(["k1"]), "agent_b": reply(["k2", "k3"]), "model": reply(None)}
    result.kinds = {"agent_a": "agent", "agent_b": "agent", "model": "model"}
    assert result.ended_keys() == {"k1", "k2", "k3"}  # a model server's None does not count
    result.replies["agent_c"], result.kinds["agent_c"] = reply(None), "agent"
    assert result.ended_keys() is None
