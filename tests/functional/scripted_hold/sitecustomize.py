"""Test-only instrument: the run's scripted backend holds chosen turns from its start (a gate the test opens).

``NEMO_RL_TEST_ONLY_SCRIPTED_HOLD=<dir>`` in a run's environment, with this directory first on ``PYTHONPATH``
(``tests/functional/test_replay_recovery.py``). ``<dir>/holds.json`` lists ``[user text, turn]`` pairs. In the
driver, right after the scripted backend got its plans (``ScriptedBackend.plans_from_rows``: before Gym starts,
so before any rollout), each pair is held there and ``<dir>/backend_url`` is written; the test reads the
backend's calls and releases the holds through it. A held rollout stops with exactly ``turn`` finished model
calls and stays so across every snapshot, on a fast machine as on a slow one: a test that kills the run once a
committed snapshot holds those calls waits for that event, not for a run slow enough to contain it. A run
without the variable (the relaunch) holds nothing.

Python imports one ``sitecustomize``: this one also loads ``examples/bench/instrument/sitecustomize.py``, so
the model-call audit (``BENCH_AUDIT_DIR``: one line per generation that reaches the backend) works with it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

ENV = "NEMO_RL_TEST_ONLY_SCRIPTED_HOLD"
_BENCH = Path(__file__).resolve().parents[3] / "examples" / "bench" / "instrument" / "sitecustomize.py"


def _install(module) -> None:
    gate = Path(os.environ[ENV])
    holds = json.loads((gate / "holds.json").read_text())
    backend = module.ScriptedBackend
    plans_from_rows = backend.plans_from_rows

    def held_plans_from_rows(self, *args, **kwargs):
        plans = plans_from_rows(self, *args, **kwargs)
        for user, turn in holds:
            self.hold(user, int(turn))
        tmp = gate / "backend_url.tmp"
        tmp.write_text(self.url)
        tmp.replace(gate / "backend_url")
        print(f"scripted hold: {len(holds)} turn(s) held at {self.url}", file=sys.stderr, flush=True)
        return plans

    backend.plans_from_rows = held_plans_from_rows


def _load_bench_instrument() -> None:
    spec = importlib.util.spec_from_file_location("bench_instrument_sitecustomize", _BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


if os.environ.get(ENV):
    from testkit.after_import import AfterImport

    sys.meta_path.insert(0, AfterImport({"gym_patches.fakes.scripted_backend": _install}))
_load_bench_instrument()
