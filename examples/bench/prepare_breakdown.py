"""Where a snapshot's prepare spent its time, server by server (docs/benchmarks.md §1c).

Reads a run directory of the recovery benchmark (``--keep-workdir``: its ``snapshot-timing.jsonl`` and
``logs/snapshots.jsonl``, or a kept copy with both files side by side) and the ``BENCH_CONTROL_LOG`` directory of the same run, and prints, for
burst and steady attempts apart, the median and longest of: the controller's prepare call, the time
until the first server's handler ran, each server's handler (its close, its wait for readiness, its
capture) and the gap before it, and the tail after the last. The servers are named by kind from the
names the Workplace configs give them.

    python examples/bench/prepare_breakdown.py RUN_DIR CONTROL_LOG_DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

KINDS = {"policy_model": "model", "workplace_simple_agent": "agent", "workplace_assistant": "resources"}


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def breakdown(run_dir: Path, control_dir: Path) -> dict[str, list[dict[str, float]]]:
    prepares = [e for e in _lines(run_dir / "snapshot-timing.jsonl") if e["event"] == "gym:prepare"]
    snapshots = run_dir / "logs" / "snapshots.jsonl"
    if not snapshots.exists():  # a kept copy (docs/benchmarks/) has it beside the timing file
        snapshots = run_dir / "snapshots.jsonl"
    burst = {s.get("checkpoint_id") for s in _lines(snapshots) if (s.get("not_admitted") or 0) > 0}
    by_checkpoint: dict[str, list[dict]] = {}
    for path in sorted(control_dir.glob("control-*.jsonl")):
        for record in _lines(path):
            by_checkpoint.setdefault(record["cid"], []).append(record)
    rows: dict[str, list[dict[str, float]]] = {"burst": [], "steady": []}
    for cid, records in by_checkpoint.items():
        records.sort(key=lambda r: r["start"])
        call = next((p for p in prepares if p["start"] <= records[0]["start"] <= p["end"]), None)
        if call is None:
            continue
        row = {"prepare call": call["end"] - call["start"], "to the first handler": records[0]["start"] - call["start"]}
        previous_end = None
        for record in records:
            kind = KINDS.get(record["server"], record["server"])
            if previous_end is not None:
                row[f"{kind}: gap before"] = record["start"] - previous_end
            row[f"{kind}: handler"] = record["end"] - record["start"]
            if record.get("wait_start") is not None:
                row[f"{kind}: wait for readiness"] = record["wait_end"] - record["wait_start"]
            for step, seconds in (record.get("steps_s") or {}).items():
                row[f"{kind}: {step}"] = seconds
            previous_end = record["end"]
        row["tail after the last"] = call["end"] - previous_end
        rows["burst" if cid in burst else "steady"].append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("control_dir", type=Path)
    args = parser.parse_args()
    for label, rows in breakdown(args.run_dir, args.control_dir).items():
        if not rows:
            continue
        print(f"\n{label} attempts: {len(rows)}\n\n| ms | median | longest |\n|---|---|---|")
        for key in dict.fromkeys(k for row in rows for k in row):
            values = [row.get(key, 0.0) * 1e3 for row in rows]
            print(f"| {key} | {statistics.median(values):.1f} | {max(values):.1f} |")


if __name__ == "__main__":
    main()
