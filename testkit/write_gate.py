"""A storage writer that holds one checkpoint file write until a test lets it go: a gate a test opens.

``GatedWriter(gate_dir=..., fragments="replica-1,workplace_simple_agent")``: while ``<gate_dir>/armed``
exists, the first write (in any process of the run) of a file whose path contains every fragment creates
``<gate_dir>/reached`` and blocks until ``<gate_dir>/release`` exists (at most ``limit_s``), then writes. A
run names it in ``checkpointing.storage_writer`` (``gate_overrides``): the driver and every Gym server build
one and hand it to their stores, as for ``testkit.write_faults.FailingWriter``. So a test can make a snapshot's
persist be in progress on one replica, for as long as it needs, and act then (stop a server, send a signal)
instead of hoping a persist is slow enough.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from gym_patches.checkpoint.storage import FileSystemWriter

CLASS_PATH = "testkit.write_gate:GatedWriter"


class GatedWriter(FileSystemWriter):
    """Writes plain files; the first matching write while armed waits for the release (see the module)."""

    def __init__(self, gate_dir: str, fragments: str, limit_s: float = 120.0):
        self.gate = Path(gate_dir)
        self.fragments = [f for f in fragments.split(",") if f]
        if not self.fragments:
            raise ValueError("fragments must name at least one path fragment")
        self.limit_s = float(limit_s)

    def _hold(self, path: Path) -> None:
        if not (self.gate / "armed").exists() or not all(f in str(path) for f in self.fragments):
            return
        try:
            os.close(os.open(self.gate / "reached", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return  # another write reached the gate first: only one is held
        (self.gate / "reached.path").write_text(str(path))
        deadline = time.monotonic() + self.limit_s
        while not (self.gate / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    def write(self, path: Path, data: bytes) -> None:
        self._hold(Path(path))
        super().write(path, data)

    def open_write(self, path: Path):
        self._hold(Path(path))
        return super().open_write(path)


def gate_overrides(gate_dir: Path, fragments: str) -> list[str]:
    """The config overrides that make every process of a run write through ``GatedWriter``."""
    gate_dir.mkdir(parents=True, exist_ok=True)
    return [f"checkpointing.storage_writer.class_path={CLASS_PATH}",
            f"++checkpointing.storage_writer.kwargs.gate_dir={gate_dir}",
            f"++checkpointing.storage_writer.kwargs.fragments={fragments}"]
