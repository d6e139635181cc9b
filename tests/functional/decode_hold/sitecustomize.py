"""Test-only instrument: each batch the torch generation worker decodes waits, mid-decode, for snapshots.

``NEMO_RL_TEST_ONLY_DECODE_HOLD=<tokens>`` in a run's environment, with this directory first on
``PYTHONPATH`` (``tests/functional/test_prefix_recovery.py``, ``test_elastic_restore.py``,
``test_gym_recovery.py``, ``test_generation_recovery.py``, ``test_bench_smoke.py``). In the process that imports
``nemo_rl.models.generation.worker`` (the generation worker's Ray actor, and the driver, which never
decodes), each batch stops after ``tokens`` decode steps until two cut pins that pinned a call in flight
have arrived since it stopped, then decodes to its end. So a prefix-level snapshot finds the batch's calls
with tokens decoded and not finished, on a fast machine as on a slow one: a test that kills the run once a
committed snapshot holds a cut waits for that event, not for a run long enough to contain it. Nothing else
changes: the tokens, the pins and the replies are the worker's own.

The hold wraps the policy's ``HFPolicy.sample_batch`` (its ``between_steps`` callback), not a method of
``GenerationServer``: Ray's actor class carries the methods it had when ``ray.remote`` wrapped it, so a
patch of that class after its module ran never reaches the actor (it did not hold for that reason once,
unnoticed: each test that uses it now checks ``HELD_LINE`` in the worker's log). A batch whose calls no
snapshot pins (all on restart-only servers, which are not cut) goes on after ``HOLD_LIMIT_S``.
"""

from __future__ import annotations

import json
import os
import sys
import threading

ENV = "NEMO_RL_TEST_ONLY_DECODE_HOLD"
# A marker file's path: the first worker of the run to hold a batch whose calls a cut pinned keeps holding it until
# the worker is killed (the marker, created once, says a worker did; later workers hold as usual). A test that
# kills the worker once a committed snapshot holds that cut knows the cut's call is still decoding at the kill.
UNTIL_KILL_ENV = "NEMO_RL_TEST_ONLY_DECODE_HOLD_UNTIL_KILL"
PINS_PER_HOLD = 2
HOLD_LIMIT_S = 10.0
HELD_LINE = "decode hold: a batch was held"  # printed once per worker, in its log, when a batch first waits
UNTIL_KILL_LINE = "decode hold: holding a pinned batch until this worker is killed"


def _claim(marker: str) -> bool:
    """True for the first process of the run to create ``marker``."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _install(module) -> None:
    tokens = int(os.environ[ENV])
    state = {"pins": 0, "held": False}
    cond = threading.Condition()
    policy_cls = sys.modules["nemo_rl.models.policy"].HFPolicy
    sample_batch = policy_cls.sample_batch

    def held_sample_batch(self, *args, between_steps=None, **kwargs):
        steps = 0

        def between() -> None:
            nonlocal steps
            steps += 1
            if steps == tokens:
                with cond:
                    if not state["held"]:
                        state["held"] = True
                        print(f"{HELD_LINE} at {tokens} tokens", file=sys.stderr, flush=True)
                    seen = state["pins"]
                    pinned = cond.wait_for(lambda: state["pins"] >= seen + PINS_PER_HOLD, timeout=HOLD_LIMIT_S)
                    marker = os.environ.get(UNTIL_KILL_ENV)
                    if pinned and marker and _claim(marker):
                        print(UNTIL_KILL_LINE, file=sys.stderr, flush=True)
                        cond.wait_for(lambda: False)  # decoded tokens pinned, the call in flight: until killed
            if between_steps is not None:
                between_steps()

        return sample_batch(self, *args, between_steps=between, **kwargs)

    pins = module.CutPins.handle_pin

    async def handle_pin(self, request):
        reply = await pins(self, request)
        owner = json.loads(await request.read()).get("owner") if reply.status == 200 else None
        if owner is not None and self._pins.get(owner, ("", {}))[1]:  # it pinned a call in flight
            with cond:
                state["pins"] += 1
                cond.notify_all()
        return reply

    policy_cls.sample_batch = held_sample_batch
    module.CutPins.handle_pin = handle_pin
    print(f"decode hold: each batch waits at {tokens} tokens for {PINS_PER_HOLD} cut pins", file=sys.stderr,
          flush=True)


if os.environ.get(ENV):
    from testkit.after_import import AfterImport

    sys.meta_path.insert(0, AfterImport({"nemo_rl.models.generation.worker": _install}))
