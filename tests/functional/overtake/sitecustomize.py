"""Test-only instrument: snapshots overtaken by a trainer checkpoint, on purpose (issue 34 test).

``NEMO_RL_TEST_ONLY_OVERTAKE=<step>:<cut|write>[,<step>:<cut|write>...]`` in a run's environment,
with this directory first on ``PYTHONPATH`` (``tests/functional/test_overtaken_snapshots.py``).
Nothing is changed but *when* things happen, in the driver (the only process that imports the
modules below; every other process pays nothing):

- the recording trainer's ``save`` of each named step first waits until ``BEGUN_WHILE_SAVING``
  snapshot attempts began and ended during it (a slow checkpoint write: snapshots begin while
  the step is trained but not yet durable), then until an attempt stands at the step's point,
  so the step's publish lands inside that attempt;
- that attempt waits there until the anchor has moved: ``cut`` stands inside the pause, before
  the capture (the drain: the capture then sees the new step), ``write`` after resume, before
  the publish (the capture was of the older step).

``NEMO_RL_TEST_ONLY_OVERTAKE_KILL=<step>`` SIGKILLs the run's process group once that step's
``save_trainer_checkpoint`` returned (published and pruned: the ``checkpointed`` crash point
comes before the prune), as ``testkit/crash_points.py`` does.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time

ENV = "NEMO_RL_TEST_ONLY_OVERTAKE"
KILL_ENV = "NEMO_RL_TEST_ONLY_OVERTAKE_KILL"
BEGUN_WHILE_SAVING = 2
RENDEZVOUS_S = 20.0


def _say(text: str) -> None:
    print(f"overtake instrument: {text}", file=sys.stderr, flush=True)


class _Rendezvous:
    def __init__(self, points: dict[int, str]):
        self.points = points  # step -> where its publish lands in an attempt
        self.counting = threading.Event()  # a named step's save counts the attempts begun during it
        self.counted = threading.Event()
        self.begun = 0
        self.where: str | None = None  # set while a named step's save waits for an attempt there
        self.standing = threading.Event()  # an attempt stands at the point

    def before_save(self, step: int) -> None:
        if step not in self.points:
            return
        self.begun = 0
        self.counted.clear()
        self.counting.set()
        if not self.counted.wait(RENDEZVOUS_S):
            _say(f"only {self.begun} snapshots began during step {step}'s save")
        self.counting.clear()
        self.standing.clear()
        self.where = self.points[step]
        if not self.standing.wait(RENDEZVOUS_S):
            _say(f"no snapshot reached {self.where!r} during step {step}'s save")
        self.where = None

    def attempt_ended(self, began_while_counting: bool) -> None:
        if began_while_counting:
            self.begun += 1
            if self.begun >= BEGUN_WHILE_SAVING:
                self.counted.set()

    async def at(self, where: str, anchor_step) -> None:
        if self.where != where or self.standing.is_set():
            return
        before = anchor_step()
        self.standing.set()
        deadline = time.monotonic() + RENDEZVOUS_S
        while anchor_step() == before and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        _say(f"trainer step {anchor_step()} published while a snapshot begun under {before} stood at {where!r}")


def _parse(spec: str) -> dict[int, str]:
    points = {}
    for item in spec.split(","):
        step, _, where = item.partition(":")
        if not step.isdigit() or where not in ("cut", "write"):
            raise ValueError(f"{ENV}={spec!r}: expected <step>:<cut|write>[,...]")
        points[int(step)] = where
    return points


def _install(spec: str) -> None:
    from testkit.after_import import AfterImport

    rv = _Rendezvous(_parse(spec))

    def trainer(module) -> None:
        save = module.RecordingTrainer.save

        def slow_save(self, directory, extra_state, *writer):
            rv.before_save(int(extra_state["step"]))
            return save(self, directory, extra_state, *writer)

        module.RecordingTrainer.save = slow_save

    def stagers(module) -> None:
        drain = module._GymStager._drain

        async def held_drain(self, *args, **kwargs):
            await rv.at("cut", self.inputs.anchor_step)
            return await drain(self, *args, **kwargs)

        module._GymStager._drain = held_drain

    def snapshotter(module) -> None:
        write_and_publish = module.RolloutSnapshotter._write_and_publish
        attempt = module.RolloutSnapshotter.attempt

        async def held(self, cut, outcome):
            await rv.at("write", self.inputs.anchor_step)
            return await write_and_publish(self, cut, outcome)

        async def counted(self, *args, **kwargs):
            during = rv.counting.is_set()
            try:
                return await attempt(self, *args, **kwargs)
            finally:
                rv.attempt_ended(during)

        module.RolloutSnapshotter._write_and_publish = held
        module.RolloutSnapshotter.attempt = counted

    kill_after = int(os.environ.get(KILL_ENV) or 0)

    def controller(module) -> None:
        save = module.SingleController.save_trainer_checkpoint

        async def save_then_kill(self, *args, **kwargs):
            seconds = await save(self, *args, **kwargs)
            if self.step == kill_after:
                print(f"TEST-ONLY crash: {KILL_ENV}={kill_after}: step {kill_after} published and pruned; "
                      "SIGKILL of the whole run", file=sys.stderr, flush=True)
                if os.getpgid(0) == os.getpid():
                    os.killpg(os.getpid(), signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)
            return seconds

        module.SingleController.save_trainer_checkpoint = save_then_kill

    prefix = "nemo_rl.algorithms.single_controller_utils.rollout_snapshot."
    AfterImport.install({"nemo_rl.algorithms.recording_trainer": trainer, prefix + "stagers": stagers,
                         prefix + "snapshotter": snapshotter, "nemo_rl.algorithms.single_controller": controller})


if os.environ.get(ENV):
    try:
        _install(os.environ[ENV])
    except Exception as _exc:  # never break interpreter startup; the test sees the missing rendezvous
        _say(f"not installed in pid {os.getpid()}: {_exc!r}")
