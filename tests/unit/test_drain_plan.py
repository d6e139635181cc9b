"""The snapshot drain waits only for replies that may be on the wire (docs/design.md §5.4).

Inside the pause, a turn-level rollout the ledger dispatched to an instance that Gym neither exported
nor reported unsaved either ended in Gym a moment ago (its reply is on its way: worth a short wait,
or its finished work would be restarted) or has not reached the agent yet (its ``/run`` is still
queued: nothing it did can be lost, and waiting for it only lengthens the pause, by the whole grace
during a step's burst of ``/run`` calls). The agents say which runs they answered lately; an instance
whose agents do not say has every such rollout waited for, as before.
"""

from __future__ import annotations

from gym_patches.checkpoint.coordination import PrepareResult
from gym_patches.checkpoint.wire import PrepareReply, PrepareReport
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.stagers import drain_plan


def reply(ended: list[str] | None) -> PrepareReply:
    return PrepareReply(phase="prepared", report=PrepareReport(ready=True, ended=ended))


def test_only_rollouts_the_agents_answered_lately_are_waited_for():
    scope = {"s/replica-0": {"held": "a", "ended": "a", "queued": "a"}, "s/replica-1": {"q2": "a", "e2": "a"}}
    exported = {"s/replica-0": {"held"}, "s/replica-1": set()}
    ended = {"s/replica-0": {"ended", "unrelated"}, "s/replica-1": {"e2"}}
    wait, not_started = drain_plan(scope, exported, ended)
    assert wait == {"ended": "s/replica-0", "e2": "s/replica-1"}
    assert not_started == {"s/replica-0": {"queued"}, "s/replica-1": {"q2"}}


def test_an_instance_whose_agents_do_not_say_has_every_missing_rollout_waited_for():
    scope = {"old": {"x": "a", "y": "a"}, "new": {"z": "a"}}
    wait, not_started = drain_plan(scope, {"old": {"x"}, "new": set()}, {"old": None, "new": set()})
    assert wait == {"y": "old"} and not_started == {"old": set(), "new": {"z"}}


def test_the_prepare_result_unions_its_agents_ended_runs_and_says_none_if_one_agent_did_not():
    result = PrepareResult(prepared=True)
    result.replies = {"agent_a": reply(["k1"]), "agent_b": reply(["k2", "k3"]), "model": reply(None)}
    result.kinds = {"agent_a": "agent", "agent_b": "agent", "model": "model"}
    assert result.ended_keys() == {"k1", "k2", "k3"}  # a model server's None does not count
    result.replies["agent_c"], result.kinds["agent_c"] = reply(None), "agent"
    assert result.ended_keys() is None
