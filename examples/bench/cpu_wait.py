"""How long each process of a benchmark run waited for a CPU inside its snapshot pauses.

    python examples/bench/cpu_wait.py sample --out W/cpu.jsonl &       # beside the benchmark, until killed
    python examples/bench/cpu_wait.py report W/cpu.jsonl W/cost-staged-8192-disk-idle

A Gym server's event loop serves a control request once the loop gets to it *and* once its process
is on a CPU. On this 2-core machine a burst keeps more processes runnable than there are cores, so
part of a burst pause may be time the servers spent runnable but not running (docs/benchmarks.md
§1c). The kernel counts that per thread (``/proc/<pid>/schedstat``: time on a CPU, time waiting in
the run queue); ``sample`` reads it for the main thread (the event loop's) of every Python process
every ``--interval`` seconds, and the system-wide CPU pressure (``/proc/pressure/cpu``, "some": time
in which at least one task waited for a CPU). ``report`` cuts both at each snapshot attempt's
pause (``snapshot-timing.jsonl`` of a ``--keep-workdir`` run), interpolating between samples, and
prints the medians for burst attempts (the step's runs still being admitted: ``not_admitted`` > 0)
and steady ones. Processes are named by what they run: a Gym server by ``NEMO_GYM_CONFIG_PATH``,
the controller (``run_grpo``), a Ray worker by its title (``ray::<actor>``).
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

PRESSURE = "/proc/pressure/cpu"


def process_name(pid: int) -> str | None:
    """What a process runs, or None for one that is not Python / Ray (or is gone)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        argv = [a.decode(errors="replace") for a in cmdline if a]
    except OSError:
        return None
    if not argv:
        return None
    if argv[0].startswith("ray::"):
        return argv[0].split()[0].split(".")[0]  # ``ray::Actor.method`` while it runs one
    if "python" not in Path(argv[0]).name:
        return None
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        environ = []
    for item in environ:
        if item.startswith(b"NEMO_GYM_CONFIG_PATH="):
            return "gym:" + item.split(b"=", 1)[1].decode(errors="replace")
    joined = " ".join(argv[1:4])
    if "run_grpo" in joined:
        return "controller"
    return None  # the benchmark's own harness, pytest, this sampler: not part of the run


def read_schedstat(pid: int, all_threads: bool = False) -> tuple[int, int] | None:
    """(ns on a CPU, ns runnable but waiting) of ``pid``'s main thread, or summed over its threads."""
    try:
        if not all_threads:
            run_ns, wait_ns, _ = Path(f"/proc/{pid}/schedstat").read_text().split()
            return int(run_ns), int(wait_ns)
        run_total = wait_total = 0
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                run_ns, wait_ns, _ = f.read().split()
            run_total += int(run_ns)
            wait_total += int(wait_ns)
        return run_total, wait_total
    except (OSError, ValueError):
        return None


def read_pressure_us() -> int | None:
    """Microseconds (since boot) in which some task waited for a CPU."""
    try:
        first = Path(PRESSURE).read_text().splitlines()[0]
        return int(first.rsplit("total=", 1)[1])
    except (OSError, IndexError, ValueError):
        return None


def sample(out: Path, interval_s: float, rescan_s: float = 1.0) -> None:
    """Append one line per ``interval_s`` until SIGTERM / SIGINT: ``{t, some_us, p: {pid: [run, wait]},
    n: {pid: name}}`` (``n`` only where a name is new). A Ray worker counts all its threads (an async
    actor's loop is not its main thread) and is named again while its title is ``ray::IDLE``."""
    stop = False

    def _stop(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    names: dict[int, str] = {}
    fresh: dict[int, str] = {}
    last_scan = 0.0
    me = os.getpid()
    with open(out, "a", buffering=1) as f:
        while not stop:
            now = time.time()
            if now - last_scan >= rescan_s:
                last_scan = now
                pids = {int(p) for p in os.listdir("/proc") if p.isdigit()} - {me}
                # Named again until named for good: a Ray worker takes its title after it starts.
                found = {pid: names[pid] if names.get(pid) not in (None, "ray::IDLE") else process_name(pid)
                         for pid in pids}
                fresh = {pid: name for pid, name in found.items() if name and names.get(pid) != name}
                names = {pid: name for pid, name in found.items() if name}
            stats = {}
            for pid, name in names.items():
                st = read_schedstat(pid, all_threads=name.startswith("ray::") and name != "ray::IDLE")
                if st is not None:
                    stats[pid] = st
            row = {"t": now, "some_us": read_pressure_us(), "p": stats}
            if fresh:
                row["n"], fresh = fresh, {}
            f.write(json.dumps(row, separators=(",", ":")) + "\n")
            time.sleep(max(0.0, interval_s - (time.time() - now)))
        f.write(json.dumps({"sampler_cpu_s": time.process_time()}) + "\n")  # what sampling cost


class Series:
    """One counter over time, read at any instant by linear interpolation between samples."""

    def __init__(self) -> None:
        self.t: list[float] = []
        self.v: list[float] = []

    def add(self, t: float, v: float) -> None:
        self.t.append(t)
        self.v.append(v)

    def at(self, t: float) -> float | None:
        i = bisect.bisect_left(self.t, t)
        if i == 0 or i >= len(self.t):
            return None  # outside what was sampled
        t0, t1, v0, v1 = self.t[i - 1], self.t[i], self.v[i - 1], self.v[i]
        return v0 + (v1 - v0) * (t - t0) / (t1 - t0)

    def over(self, start: float, end: float) -> float | None:
        a, b = self.at(start), self.at(end)
        return None if a is None or b is None else b - a


def load_samples(path: Path) -> tuple[dict[str, tuple[Series, Series]], Series]:
    """Per process (``name@pid``, by the last name it had): (run ns, wait ns) series; and the system's
    "some" CPU pressure (µs)."""
    by_pid: dict[str, tuple[Series, Series]] = {}
    names: dict[str, str] = {}
    some = Series()
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if "t" not in row:
            continue
        names.update(row.get("n", {}))
        if row.get("some_us") is not None:
            some.add(row["t"], row["some_us"])
        for pid, (run_ns, wait_ns) in row["p"].items():
            run, wait = by_pid.setdefault(pid, (Series(), Series()))
            run.add(row["t"], run_ns)
            wait.add(row["t"], wait_ns)
    return {f"{names.get(pid, '?')}@{pid}": series for pid, series in by_pid.items()}, some


def pauses(run_dir: Path) -> list[dict]:
    """The snapshot attempts of a run: start, pause end, and whether it was cut in a burst."""
    timing = run_dir / "snapshot-timing.jsonl"
    out = []
    for line in timing.read_text().splitlines():
        row = json.loads(line)
        if row.get("event") == "attempt" and row.get("pause_s") is not None:
            out.append({"start": row["start"], "end": row["start"] + row["pause_s"],
                        "burst": int(row.get("not_admitted", 0)) > 0})
    return out


def report(samples_path: Path, run_dir: Path) -> dict[str, dict[str, dict[str, float]]]:
    """Per kind of attempt (burst / steady), per process name (summed over the processes of that name):
    median ms on a CPU and waiting for one inside the pause, and the pause itself; also "some"
    pressure, the share of the pause in which something waited for a CPU. A missing input file is a
    ``FileNotFoundError`` naming it and what it should be."""
    timing = run_dir / "snapshot-timing.jsonl"
    for path, what in ((samples_path, "the samples of `cpu_wait.py sample`"),
                       (timing, "the snapshot timing of a --keep-workdir benchmark run")):
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file (expected {what})")
    procs, some = load_samples(samples_path)
    rows: dict[str, dict[str, list[float]]] = {"burst": {}, "steady": {}}
    for p in pauses(run_dir):
        kind = "burst" if p["burst"] else "steady"
        got = rows[kind]
        got.setdefault("pause ms", []).append((p["end"] - p["start"]) * 1e3)
        share = some.over(p["start"], p["end"])
        if share is not None:
            got.setdefault("cpu pressure (some) %", []).append(share / 1e6 / (p["end"] - p["start"]) * 100)
        per_name: dict[str, list[float]] = {}
        for key, (run, wait) in procs.items():  # processes of one name (replicas, idle workers) add up
            r, w = run.over(p["start"], p["end"]), wait.over(p["start"], p["end"])
            if r is None or w is None:
                continue
            total = per_name.setdefault(key.rsplit("@", 1)[0], [0.0, 0.0])
            total[0] += r / 1e6
            total[1] += w / 1e6
        for name, (r, w) in per_name.items():
            got.setdefault(f"{name}: on a CPU ms", []).append(r)
            got.setdefault(f"{name}: waiting for one ms", []).append(w)
    return {kind: {k: {"median": statistics.median(v), "max": max(v), "n": len(v)} for k, v in got.items()}
            for kind, got in rows.items() if got}


def print_report(result: dict[str, dict[str, dict[str, float]]]) -> None:
    kinds = [k for k in ("steady", "burst") if k in result]
    keys = sorted({k for kind in kinds for k in result[kind]}, key=lambda k: (not k.startswith(("pause", "cpu")), k))
    print("| ms, median (max) over the pauses | " + " | ".join(f"{k} (n={result[k]['pause ms']['n']})" for k in kinds) + " |")
    print("|---|" + "---|" * len(kinds))
    for key in keys:
        cells = []
        for kind in kinds:
            v = result[kind].get(key)
            cells.append("—" if v is None else f"{v['median']:.1f} ({v['max']:.1f})")
        print(f"| {key} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sample", help="sample until SIGTERM")
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--interval", type=float, default=0.02)
    r = sub.add_parser("report", help="cut the samples at each snapshot pause of a kept run directory")
    r.add_argument("samples", type=Path)
    r.add_argument("run_dir", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "sample":
        sample(args.out, args.interval)
        return
    try:
        result = report(args.samples, args.run_dir)
    except FileNotFoundError as exc:
        ap.error(str(exc))
    print_report(result)


if __name__ == "__main__":
    sys.exit(main())
