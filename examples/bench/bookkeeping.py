"""Trainer-checkpoint bookkeeping: bytes read and seconds per save, and for a restore-point lookup.

    python examples/bench/bookkeeping.py                                   # 10 MB, 100 MB, 1 GB per step
    python examples/bench/bookkeeping.py --sizes-mb 10,100 --compare-full-verify --out /tmp/bookkeeping.json
    python examples/bench_recovery.py --only bookkeeping      # the same, as a measurement of the benchmark

For each step size, ``--saves`` trainer steps are saved into a fresh checkpoint
directory with ``keep_top_k=--keep`` (3), as the controller saves them
(``SingleController.save_trainer_checkpoint``):

- **save**: a stand-in for the trainer's files. Two thirds of the step is
  ``optimizer.pt`` plus a small ``trainer_state.json``, written through
  ``write_bytes_atomic`` inside ``recording_digests`` (as the GRPO trainer
  writes them); one third is ``model.safetensors``, written with a plain
  ``open/write/fsync`` the way ``save_pretrained`` does, so the seal must hash
  it. (AdamW keeps two fp32 moments per weight: about this split.)
- **seal**: ``publish_trainer_step`` (manifest, rename);
- **prune**: ``prune_trainer_steps`` (lists the kept steps, removes the oldest).

Bookkeeping is seal + prune. After the last save, one **restore-point lookup**
(``resolve_restore_point``) is measured.

``--compare-full-verify`` also runs the behaviour before commit-marker trust
(what ``list_trainer_steps`` and the seal did up to commit 923a7c3), built here
from the store's own primitives: every file written without digests so the
seal hashes all of them, and listing (for prune and restore) runs
``verify_directory`` -- every sha256 -- on every anchor.

Bytes read are the kernel's count of bytes this process read through
``read()``-family calls (``rchar`` in ``/proc/self/io``, Linux), taken around
each phase in this single-threaded process: it counts reads served from the
page cache too, so it measures what the code reads, not what the disk did.
Seconds are wall clock with a warm page cache (each step was just written), so
they understate a cold restore. Writes a JSON of every save to ``--out``.

Goals (issue 21), on the ``trust`` rows: a save's bookkeeping reads at most one
pass over its own bytes, its prune reads no checkpoint bytes (never rereads kept
steps), and a restore-point lookup reads at most one step (it hashes only the
checkpoint it restores); ``PASS_SLACK`` of a step allows for manifests.

As a measurement of ``examples/bench_recovery.py`` (``--only bookkeeping``):
``measure(workdir=..., log=..., sizes_mb=..., saves=..., keep=..., compare_full_verify=...)``
and ``table(result)``, like the other ``bench`` modules.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from nemo_rl.utils.atomic_write import recording_digests, write_bytes_atomic, write_json_atomic  # noqa: E402
from nemo_rl.utils.snapshot_store import (  # noqa: E402
    BOOTSTRAP_DIRNAME,
    SnapshotStoreError,
    anchor_dir,
    prepare_trainer_step,
    prune_trainer_steps,
    publish_trainer_step,
    resolve_latest_snapshot,
    resolve_restore_point,
    verify_directory,
)

MB = 1 << 20
MODES = ("trust", "full_verify")
NAME = "bookkeeping"
TITLE = "8. Trainer-checkpoint bookkeeping: bytes read and seconds per save and per restore-point lookup"
PASS_SLACK = 0.02  # of one step's bytes: manifests and small JSON read besides the checkpoint's files


# ----- measuring ---------------------------------------------------------------------------------
def rchar() -> int:
    """Bytes this process has read so far (``/proc/self/io``)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no rchar line")


class Phase:
    """Seconds and bytes read inside one ``with``; the read of ``/proc/self/io`` itself is subtracted."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.read = 0
        probe = rchar()
        self._probe_cost = rchar() - probe

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        r0, t0 = rchar(), time.perf_counter()
        yield
        self.seconds = time.perf_counter() - t0
        self.read = max(0, rchar() - r0 - self._probe_cost)


# ----- a stand-in trainer save ------------------------------------------------------------------
class StepPayload:
    """The bytes of one step: optimizer (2/3) through ``write_bytes_atomic``, weights (1/3) written plainly."""

    def __init__(self, size: int):
        self.weights = os.urandom(size // 3)
        self.optimizer = os.urandom(size - len(self.weights))

    @property
    def size(self) -> int:
        return len(self.weights) + len(self.optimizer)

    def save(self, directory: Path, step: int) -> None:
        write_bytes_atomic(directory / "optimizer.pt", self.optimizer)
        with open(directory / "model.safetensors", "wb") as fh:  # like save_pretrained: not through the store
            fh.write(self.weights)
            fh.flush()
            os.fsync(fh.fileno())
        write_json_atomic(directory / "trainer_state.json", {"step": step})


# ----- the behaviour before commit-marker trust (for --compare-full-verify) -------------------------
def full_verify_list(checkpoint_dir: Path) -> list[int]:
    """``list_trainer_steps`` as it was: every anchor verified, every sha256 read."""
    steps = []
    for path in checkpoint_dir.iterdir():
        if path.name == BOOTSTRAP_DIRNAME:
            kind, step = "bootstrap", 0
        elif path.name.startswith("step_") and path.name[5:].isdigit():
            kind, step = "trainer_step", int(path.name[5:])
        else:
            continue
        with contextlib.suppress(SnapshotStoreError):
            if verify_directory(path, kind).sequence == step:
                steps.append(step)
    return sorted(steps)


def full_verify_prune(checkpoint_dir: Path, keep: int, newest: int) -> None:
    full_verify_list(checkpoint_dir)  # what the old prune read; the removal below only stats
    prune_trainer_steps(checkpoint_dir, keep, newest)


def full_verify_restore_point(checkpoint_dir: Path) -> int | None:
    steps = full_verify_list(checkpoint_dir)
    if not steps:
        return None
    resolve_latest_snapshot(anchor_dir(checkpoint_dir, steps[-1]))
    return steps[-1]


# ----- one size, one mode -----------------------------------------------------------------------
def measure_size(size_mb: float, mode: str, *, saves: int, keep: int, workdir: Path,
                 log: Callable[[str], None] = print) -> dict[str, Any]:
    """``saves`` steps of about ``size_mb`` each, then a restore-point lookup; every phase timed and counted."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} must be one of {MODES}")
    payload = StepPayload(int(size_mb * MB))
    ckpt = workdir / f"ckpt_{size_mb:g}mb_{mode}"
    shutil.rmtree(ckpt, ignore_errors=True)
    ckpt.mkdir(parents=True)
    rows = []
    try:
        for step in range(1, saves + 1):
            write, seal, prune = Phase(), Phase(), Phase()
            tmp, final = prepare_trainer_step(ckpt, step)
            with write():
                if mode == "trust":
                    with recording_digests(tmp) as digests:
                        payload.save(tmp, step)
                else:
                    digests = None
                    payload.save(tmp, step)
            with seal():
                publish_trainer_step(tmp, final, metadata={"step": step}, digests=digests)
            with prune():
                if mode == "trust":
                    prune_trainer_steps(ckpt, keep, step)
                else:
                    full_verify_prune(ckpt, keep, step)
            step_bytes = sum(p.stat().st_size for p in final.iterdir() if p.is_file())
            row = {
                "save": step, "step_bytes": step_bytes,
                "write_s": round(write.seconds, 4), "write_read": write.read,
                "seal_s": round(seal.seconds, 4), "seal_read": seal.read,
                "prune_s": round(prune.seconds, 4), "prune_read": prune.read,
                "bookkeeping_s": round(seal.seconds + prune.seconds, 4),
                "bookkeeping_read": seal.read + prune.read,
                "bookkeeping_passes": round((seal.read + prune.read) / step_bytes, 3),
                "checkpoint_s": round(write.seconds + seal.seconds + prune.seconds, 4),
            }
            rows.append(row)
            log(f"{size_mb:g} MB {mode}: save {step}: bookkeeping {row['bookkeeping_passes']} passes, "
                f"{row['bookkeeping_s']} s (write {row['write_s']} s)")
        lookup = Phase()
        with lookup():
            if mode == "trust":
                point = resolve_restore_point(ckpt)
                restored = point.step if point is not None else None
            else:
                restored = full_verify_restore_point(ckpt)
        if restored != saves:
            raise RuntimeError(f"{ckpt}: restore-point lookup found step {restored}, expected {saves}")
        step_bytes = rows[-1]["step_bytes"]
        restore = {"s": round(lookup.seconds, 4), "read": lookup.read,
                   "passes": round(lookup.read / step_bytes, 3), "step": restored}
        log(f"{size_mb:g} MB {mode}: restore-point lookup {restore['passes']} passes, {restore['s']} s")
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    return {"size_mb": size_mb, "mode": mode, "keep": keep, "saves": rows, "restore": restore}


# ----- report ----------------------------------------------------------------------------------
def md_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def results_table(results: list[dict[str, Any]]) -> str:
    header = ["step", "mode", "bookkeeping read / save (median, max)", "bookkeeping s / save (median)",
              "save write s (median)", "checkpoint_s first → last", "restore lookup read", "restore lookup s"]
    rows = []
    for res in results:
        saves = res["saves"]
        mb = saves[-1]["step_bytes"] / MB
        passes = [s["bookkeeping_passes"] for s in saves]
        rows.append([
            f"{mb:.0f} MB", "before (full verify)" if res["mode"] == "full_verify" else "after (trust)",
            f"{statistics.median(passes):.2f}, {max(passes):.2f} passes "
            f"({statistics.median(s['bookkeeping_read'] for s in saves) / MB:.1f} MB)",
            f"{statistics.median(s['bookkeeping_s'] for s in saves):.3f}",
            f"{statistics.median(s['write_s'] for s in saves):.3f}",
            f"{saves[0]['checkpoint_s']:.3f} → {saves[-1]['checkpoint_s']:.3f}",
            f"{res['restore']['passes']:.2f} passes ({res['restore']['read'] / MB:.1f} MB)",
            f"{res['restore']['s']:.3f}",
        ])
    return md_table(header, rows)


# ----- as a measurement of bench_recovery.py ----------------------------------------------------
def measure(*, workdir: Path, log: Callable[[str], None] = print,
            sizes_mb: list[float] | tuple[float, ...] = (10, 100, 1024), saves: int = 6, keep: int = 3,
            compare_full_verify: bool = False) -> dict[str, Any]:
    """Every size (and, with ``compare_full_verify``, the behaviour before commit-marker trust),
    in a fresh directory under ``workdir`` that is removed afterwards."""
    sizes = [float(s) for s in sizes_mb]
    if not sizes or any(s <= 0 for s in sizes):
        raise ValueError(f"bookkeeping sizes_mb={list(sizes_mb)!r} must list sizes above 0")
    if saves < 1 or keep < 1:
        raise ValueError(f"bookkeeping saves={saves} and keep={keep} must be >= 1")
    if not Path("/proc/self/io").exists():
        raise RuntimeError("bookkeeping: bytes read are taken from /proc/self/io (Linux only)")
    modes = ["trust", "full_verify"] if compare_full_verify else ["trust"]
    root = Path(workdir) / NAME
    root.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        for size in sizes:
            for mode in modes:
                results.append(measure_size(size, mode, saves=saves, keep=keep, workdir=root, log=log))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"name": NAME, "title": TITLE, "results": results, "goal": goal_of(results),
            "config": {"sizes_mb": sizes, "saves": saves, "keep": keep, "modes": modes,
                       "bytes_read": "rchar of /proc/self/io around each phase (reads served by the page cache count)"}}


def goal_of(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 21's goals over the ``trust`` rows (None: no such row)."""
    trust = [r for r in results if r["mode"] == "trust"]
    if not trust:
        return {"save_reads_own_bytes_at_most_once": None, "prune_rereads_no_kept_step": None,
                "restore_hashes_only_the_restored_step": None, "pass_slack": PASS_SLACK}
    save_passes = max(s["bookkeeping_passes"] for r in trust for s in r["saves"])
    prune_passes = max(s["prune_read"] / s["step_bytes"] for r in trust for s in r["saves"])
    restore_passes = max(r["restore"]["passes"] for r in trust)
    return {"save_reads_own_bytes_at_most_once": save_passes <= 1 + PASS_SLACK,
            "prune_rereads_no_kept_step": prune_passes <= PASS_SLACK,
            "restore_hashes_only_the_restored_step": restore_passes <= 1 + PASS_SLACK,
            "max_save_passes": save_passes, "max_prune_passes": round(prune_passes, 4),
            "max_restore_passes": restore_passes, "pass_slack": PASS_SLACK}


def table(res: dict[str, Any]) -> str:
    """The rows of a ``measure`` result, with what a pass is."""
    c = res["config"]
    return (results_table(res["results"]) + "\n\n"
            f"keep_top_k={c['keep']}, {c['saves']} saves per row. A pass = one step's bytes; bytes read = "
            f"{c['bytes_read']}. *before (full verify)* rebuilds, from the store's own primitives, what listing "
            "and sealing did before commit-marker trust (every kept step hashed on every prune and lookup).")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mb", default="10,100,1024", help="step sizes in MB, comma separated")
    p.add_argument("--saves", type=int, default=6)
    p.add_argument("--keep", type=int, default=3, help="checkpointing.keep_top_k")
    p.add_argument("--compare-full-verify", action="store_true",
                   help="also measure the behaviour before commit-marker trust (every kept step hashed)")
    p.add_argument("--workdir", type=Path, default=None, help="where the steps are written (default: a temp dir)")
    p.add_argument("--out", type=Path, default=Path("bookkeeping.json"))
    args = p.parse_args(argv)
    try:
        sizes = [float(s) for s in args.sizes_mb.split(",") if s.strip()]
    except ValueError:
        p.error(f"--sizes-mb={args.sizes_mb!r} must be numbers separated by commas (e.g. 10,100)")
    if not sizes or any(s <= 0 for s in sizes):
        p.error(f"--sizes-mb={args.sizes_mb!r} must list sizes above 0")
    if args.saves < 1 or args.keep < 1:
        p.error("--saves and --keep must be >= 1")
    if not Path("/proc/self/io").exists():
        p.error("bytes read are taken from /proc/self/io (Linux only)")
    with tempfile.TemporaryDirectory(prefix="bookkeeping-", dir=args.workdir) as workdir:
        res = measure(workdir=Path(workdir), sizes_mb=sizes, saves=args.saves, keep=args.keep,
                      compare_full_verify=args.compare_full_verify)
    print()
    print(f"Trainer-checkpoint bookkeeping, keep_top_k={args.keep}, {args.saves} saves per row "
          "(a pass = one step's bytes; bytes read = rchar of /proc/self/io)")
    print(results_table(res["results"]))
    record = {"keep": args.keep, "saves": args.saves, "sizes_mb": sizes, "bytes_read": res["config"]["bytes_read"],
              "results": res["results"], "goal": res["goal"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
