"""Test-only seams of the recovery parity tests (``tests/functional/test_recovery_parity.py``), installed in
every process of a run that has this directory first on ``PYTHONPATH``:

- ``NEMO_RL_TEST_ONLY_PARITY_GATE=<faults_state.json>|<tokens>``: in the generation worker, a call
  (deterministic mode decodes one at a time) that reaches ``tokens`` decode steps while the parity harness
  is busy (its ``faults_state.json``: the next fault armed, or an in-run fault's recovery awaited) waits
  there until it is not. So a fault, which waits for committed snapshots holding rollouts in flight (at
  prefix level, with a generation cut), finds them on any machine, fast or slow, and the run does not end
  while a recovery is still to be seen; between faults (the harness waits for steps to be trained) nothing
  is held. The tokens and replies are the worker's own; a hold ends after ``HOLD_LIMIT_S`` whatever happens
  (then the next call may hold; a fault never delivered is reported by the harness).
- ``NEMO_RL_TEST_ONLY_PARITY_MUTATION=restored_logprobs``: in the driver, the first logprob of every sample
  whose rollout continued from a restored boundary (``restored_from``) is moved by 0.01: the bug "a
  restored turn carries a wrong logprob" that parity must catch and name.

Both wrap product functions from outside after their module is imported (``testkit.after_import``); the
product has no branch for them.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

GATE_ENV = "NEMO_RL_TEST_ONLY_PARITY_GATE"
MUTATION_ENV = "NEMO_RL_TEST_ONLY_PARITY_MUTATION"
HOLD_LIMIT_S = 30.0
HELD_LINE = "parity gate: a call was held"
PERTURBATION = 0.01


def _busy(path: Path) -> bool:
    """Whether the harness, as it last wrote, has a fault armed or a recovery awaited (False before it wrote)."""
    try:
        return bool(json.loads(path.read_text())["busy"])
    except (OSError, ValueError, KeyError):
        return False


def _install_gate(module) -> None:
    path_text, tokens_text = os.environ[GATE_ENV].split("|")
    path, tokens = Path(path_text), int(tokens_text)
    sample_batch = module.HFPolicy.sample_batch
    announced = threading.Event()

    def gated_sample_batch(self, *args, between_steps=None, **kwargs):
        steps = 0

        def between() -> None:
            nonlocal steps
            steps += 1
            if steps == tokens and _busy(path):
                if not announced.is_set():
                    announced.set()
                    print(f"{HELD_LINE} at {tokens} tokens", file=sys.stderr, flush=True)
                deadline = time.monotonic() + HOLD_LIMIT_S
                while _busy(path) and time.monotonic() < deadline:
                    time.sleep(0.05)
            if between_steps is not None:
                between_steps()

        return sample_batch(self, *args, between_steps=between, **kwargs)

    module.HFPolicy.sample_batch = gated_sample_batch


def _install_mutation(module) -> None:
    kind = os.environ[MUTATION_ENV]
    if kind != "restored_logprobs":
        raise ValueError(f"{MUTATION_ENV}={kind!r}: the only mutation is restored_logprobs")
    original = module.sample_from_run_reply

    def mutated(reply, **kwargs):
        sample = original(reply, **kwargs)
        if sample.restored_from is not None and sample.calls and sample.calls[0].generation_log_probs:
            sample.calls[0].generation_log_probs[0] += PERTURBATION
        return sample

    module.sample_from_run_reply = mutated


_hooks = {}
if os.environ.get(GATE_ENV):
    _hooks["nemo_rl.models.policy"] = _install_gate
if os.environ.get(MUTATION_ENV):
    _hooks["nemo_rl.experience.rollouts"] = _install_mutation
if _hooks:
    from testkit.after_import import AfterImport

    sys.meta_path.insert(0, AfterImport(_hooks))
