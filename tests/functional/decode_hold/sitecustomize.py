"""Test-only instrument: each batch the torch generation worker decodes waits, mid-decode, for snapshots.

``NEMO_RL_TEST_ONLY_DECODE_HOLD=<tokens>`` in a run's environment, with this directory first on
``PYTHONPATH`` (``tests/functional/test_prefix_recovery.py``, ``test_elastic_restore.py``). In the process
that imports ``nemo_rl.models.generation.worker`` (the generation worker's Ray actor; every other process
pays nothing), each batch stops after ``tokens`` decode steps until two generation-cut pins (two snapshots'
cuts) have arrived since it stopped, then decodes to its end. So a prefix-level snapshot always finds the
batch's calls with tokens decoded and not finished, on a fast machine as on a slow one: a test that kills the
run once a committed snapshot holds a cut waits for that event, not for a run long enough to contain it.
Nothing else changes: the tokens, the pins and the replies are the worker's own. The hold ends after
``HOLD_LIMIT_S`` without pins (a run whose snapshots stopped is not held for ever).
"""

from __future__ import annotations

import os
import sys
import threading
import time

ENV = "NEMO_RL_TEST_ONLY_DECODE_HOLD"
PINS_PER_HOLD = 2
HOLD_LIMIT_S = 120.0


def _install(module) -> None:
    tokens = int(os.environ[ENV])
    server = module.GenerationServer
    state = {"pins": 0, "steps": 0}
    cond = threading.Condition()
    decode_batch, between_steps = server._decode_batch, server._between_steps

    def _decode_batch(self, jobs):
        with cond:
            state["steps"] = 0
        return decode_batch(self, jobs)

    def _between_steps(self):
        with cond:
            state["steps"] += 1
            if state["steps"] == tokens:
                seen = state["pins"]
                cond.wait_for(lambda: state["pins"] >= seen + PINS_PER_HOLD, timeout=HOLD_LIMIT_S)
        between_steps(self)

    pins = module.CutPins.handle_pin

    async def handle_pin(self, request):
        reply = await pins(self, request)
        with cond:
            state["pins"] += 1
            cond.notify_all()
        return reply

    server._decode_batch, server._between_steps = _decode_batch, _between_steps
    module.CutPins.handle_pin = handle_pin
    print(f"decode hold: each batch waits at {tokens} tokens for {PINS_PER_HOLD} cut pins", file=sys.stderr,
          flush=True)


if os.environ.get(ENV):
    from testkit.after_import import AfterImport

    sys.meta_path.insert(0, AfterImport({"nemo_rl.models.generation.worker": _install}))
