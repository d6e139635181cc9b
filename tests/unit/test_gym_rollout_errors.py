"""A rollout's error keeps its class and fields across Ray (pickled out of the replica's actor): the controller
tells a refusal (Gym closed for a checkpoint: dispatch again after resume) from a failure by its class."""

from __future__ import annotations

import pickle

import ray.cloudpickle

from nemo_rl.environments.nemo_gym import GymCheckpointParked, GymRolloutError


def test_a_refusal_stays_a_refusal_across_pickling() -> None:
    refused = GymCheckpointParked("agent 'a' /run for r1 returned 409", rollout_id="r1", server="a", infra=False,
                                  code="admission_closed")
    for dumps, loads in [(pickle.dumps, pickle.loads), (ray.cloudpickle.dumps, ray.cloudpickle.loads)]:
        back = loads(dumps(refused))
        assert type(back) is GymCheckpointParked
        assert (str(back), back.rollout_id, back.server, back.infra, back.code) == (
            str(refused), "r1", "a", False, "admission_closed")
    failed = pickle.loads(pickle.dumps(GymRolloutError("boom", rollout_id="r2", server="s", infra=True)))
    assert type(failed) is GymRolloutError and failed.infra and failed.code is None
