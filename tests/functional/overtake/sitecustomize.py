"""Test-only instrument: a snapshot overtaken by a trainer checkpoint, on purpose (issue 34 test).

``NEMO_RL_TEST_ONLY_OVERTAKE=<cut|write>:<step>[,<step>...]`` in a run's environment, with
this directory first on ``PYTHONPATH`` (``tests/functional/test_overtaken_snapshots.py``).
Nothing is changed but *when* things happen, in the driver (the only process that imports the
modules below; every other process pays nothing):

- the recording trainer's ``save`` of each named step first waits until ``BEGUN_WHILE_SAVING``
  snapshot attempts began and ended during it (a slow checkpoint write: snapshots begin while
  the step is trained but not yet durable), then until an attempt stands at the chosen point,
  so the step's publish lands inside it;
- that attempt waits there until the anchor has moved: ``cut`` stands inside the pause, before
  the capture (the drain: the capture then sees the new step), ``write`` after resume, before
  the publish (the capture was of the older step).
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time

ENV = "NEMO_RL_TEST_ONLY_OVERTAKE"
BEGUN_WHILE_SAVING = 2
RENDEZVOUS_S = 20.0


class _Rendezvous:
    def __init__(self, where: str, steps: set[int]):
        self.where, self.steps = where, steps
        self.counting = threading.Event()  # a named step's save counts the attempts begun during it
        self.counted = threading.Event()
        self.begun = 0
        self.saving = threading.Event()  # a named step's save waits for an attempt at the point
        self.standing = threading.Event()  # an attempt stands at the point

    def before_save(self, step: int) -> None:
        if step not in self.steps:
            return
        self.begun = 0
        self.counted.clear()
        self.counting.set()
        if not self.counted.wait(RENDEZVOUS_S):
            print(f"overtake instrument: {self.begun} snapshots began during step {step}'s save",
                  file=sys.stderr, flush=True)
        self.counting.clear()
        self.standing.clear()
        self.saving.set()
        if not self.standing.wait(RENDEZVOUS_S):
            print(f"overtake instrument: no snapshot reached {self.where!r} during step {step}'s save",
                  file=sys.stderr, flush=True)
        self.saving.clear()

    async def at_point(self, anchor_step) -> None:
        if not self.saving.is_set():
            return
        before = anchor_step()
        self.standing.set()
        deadline = time.monotonic() + RENDEZVOUS_S
        while anchor_step() == before and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        print(f"overtake instrument: trainer step {anchor_step()} published while a snapshot begun under "
              f"{before} stood at {self.where!r}", file=sys.stderr, flush=True)


def _install(spec: str) -> None:
    from testkit.after_import import AfterImport

    where, _, steps = spec.partition(":")
    if where not in ("cut", "write") or not steps:
        raise ValueError(f"{ENV}={spec!r}: expected <cut|write>:<step>[,<step>...]")
    rv = _Rendezvous(where, {int(s) for s in steps.split(",")})

    def trainer(module) -> None:
        save = module.RecordingTrainer.save

        def slow_save(self, directory, extra_state):
            rv.before_save(int(extra_state["step"]))
            return save(self, directory, extra_state)

        module.RecordingTrainer.save = slow_save

    def stagers(module) -> None:
        drain = module._GymStager._drain

        async def held_drain(self, *args, **kwargs):
            if rv.where == "cut":
                await rv.at_point(self.inputs.anchor_step)
            return await drain(self, *args, **kwargs)

        module._GymStager._drain = held_drain

    def snapshotter(module) -> None:
        write_and_publish = module.RolloutSnapshotter._write_and_publish
        attempt = module.RolloutSnapshotter.attempt

        async def counted(self, *args, **kwargs):
            during = rv.counting.is_set()
            outcome = await attempt(self, *args, **kwargs)
            if during:
                rv.begun += 1
                if rv.begun >= BEGUN_WHILE_SAVING:
                    rv.counted.set()
            return outcome

        async def held(self, cut, outcome):
            if rv.where == "write":
                await rv.at_point(self.inputs.anchor_step)
            return await write_and_publish(self, cut, outcome)

        module.RolloutSnapshotter._write_and_publish = held
        module.RolloutSnapshotter.attempt = counted

    prefix = "nemo_rl.algorithms.single_controller_utils.rollout_snapshot."
    AfterImport.install({"nemo_rl.algorithms.recording_trainer": trainer, prefix + "stagers": stagers,
                         prefix + "snapshotter": snapshotter})


if os.environ.get(ENV):
    try:
        _install(os.environ[ENV])
    except Exception as _exc:  # never break interpreter startup; the test sees the missing rendezvous
        print(f"overtake instrument: not installed in pid {os.getpid()}: {_exc!r}", file=sys.stderr)
