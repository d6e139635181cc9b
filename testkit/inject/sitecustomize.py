"""Install the write-fault storage writer in every process of a run that asked for a fault.

Python imports ``sitecustomize`` at startup from the first ``sys.path`` entry
that has one. The harness (``testkit.run_harness.run_env``) puts this directory
and the repository on ``PYTHONPATH`` when ``NEMO_TEST_ONLY_WRITE_FAULT`` is set;
Ray workers, the Gym actors and the Gym servers they spawn inherit both, so a
Gym server writes its records through the failing writer as the driver does.
(The product reads no test variable, so a Gym server, started by the product's
launcher, cannot be handed the writer any other way.)

The writer is installed at startup as the process's default in
``gym_patches.checkpoint.storage`` (the one ``StorageWriter`` definition, which
both sides' stores import; a small module with no dependencies), and only when
the variable is set. A ``sitecustomize`` further
down ``sys.path`` (the interpreter's own, or the benchmark's) still runs.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _run_next_sitecustomize() -> None:
    """This file shadows any later ``sitecustomize``; run that one as Python would have."""
    later = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", later)
    if spec is not None and spec.loader is not None and os.path.dirname(os.path.abspath(spec.origin or "")) != _HERE:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


def _install() -> None:
    if not os.environ.get("NEMO_TEST_ONLY_WRITE_FAULT"):
        return
    from testkit.write_faults import install_from_env  # imports the storage module only (a few ms)

    install_from_env()


try:
    _install()
except Exception as _exc:  # never break interpreter startup; the driver validates the variable itself
    print(f"testkit write faults: not installed in pid {os.getpid()}: {_exc!r}", file=sys.stderr)
try:
    _run_next_sitecustomize()
except Exception as _exc:
    print(f"testkit write faults: the next sitecustomize failed: {_exc!r}", file=sys.stderr)
