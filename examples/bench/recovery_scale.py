"""Measurement 18: in-run recovery of a Gym replica with thousands of rollouts in flight (docs/design.md §5.12).

Each repeat is one real ``examples/run_grpo.py`` process on
``examples/configs/grpo_workplace_two_replicas_turn.yaml`` (scripted backend, recording trainer, two replicas of
one shard) with N rollouts in flight (``prompts x generations`` per step, half on each replica). Once a committed
snapshot holds turn-level rollouts with finished model calls on ``nemo_gym/replica-1``, the benchmark SIGKILLs that
replica's ``NemoGym`` actor and every server under it; once the recovery's row is written, the run is stopped (what
is measured is the recovery, not the rest of the run).

Read from the run's records and the model-call audit (``bench/instrument/sitecustomize.py``):

- seconds from the loss noticed to the first continued rollout sent to Gym again (``seconds_to_redispatch``), and
  of that the new replica's start (``seconds_to_start``);
- the age of the snapshot the recovery restored from at the loss (``snapshot_age_s``);
- per rollout the loss affected, the finished turns it lost: the model calls its lost attempt had finished before
  the loss, less those the restored snapshot kept of it (its saved agent state; 0 for a rollout that restarts from
  its prompt).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from bench.common import INSTRUMENT, Log, fmt, fresh_dir, make_log, md_table, summary
from bench.work_lost import saved_calls
from testkit.run_harness import new_marker, parent_pid, read_jsonl, replica_server_pids, run_env, run_once, scripted_overrides

NAME = "recovery_scale"
TITLE = "18. In-run recovery of a Gym replica at thousands of rollouts in flight"
CONFIG = "examples/configs/grpo_workplace_two_replicas_turn.yaml"
LOST = "nemo_gym/replica-1"


def measure(*, sizes: tuple[int, ...] = (4096, 8192), repeats: int = 3, workdir: Path, generations: int = 16,
            delay_s: float = 3.0, interval_s: float = 5.0, min_saved_calls: int = 1, timeout_s: float = 420.0,
            log: Log | None = None) -> dict[str, Any]:
    log = log or make_log("recovery-scale")
    results = []
    for n in sizes:
        for repeat in range(repeats):
            run_dir = fresh_dir(Path(workdir).resolve() / f"n{n}-{repeat}")
            res = run_repeat(run_dir, n, generations=generations, delay_s=delay_s, interval_s=interval_s,
                             min_saved_calls=min_saved_calls, timeout_s=timeout_s)
            res.update(n=n, repeat=repeat)
            res["lost_turns_total"], res["affected"] = sum(res.get("lost_turns", [])), len(res.get("lost_turns", []))
            log(f"N={n} #{repeat}: redispatch {res.get('seconds_to_redispatch')} s, start {res.get('seconds_to_start')} "
                f"s, snapshot age {res.get('snapshot_age_s')} s, affected {len(res.get('lost_turns', []))}"
                + (f" ({res['error'][:200]})" if res.get("error") else ""))
            results.append(res)
    rows = rows_of(results, sizes)
    return {"name": NAME, "title": TITLE, "rows": rows, "repeats": results, "goal": goal_of(results),
            "config": {"config": CONFIG, "sizes": list(sizes), "generations": generations, "delay_s": delay_s,
                       "interval_s": interval_s, "min_saved_calls": min_saved_calls}}


def _args(run_dir: Path, n: int, generations: int, delay_s: float, interval_s: float) -> list[str]:
    return ["--config", CONFIG, "policy.model_name=scripted-test-backend", "logger.plot=false",
            "logger.progress_bar=false", f"logger.log_dir={run_dir / 'logs'}",
            f"checkpointing.checkpoint_dir={run_dir / 'ckpt'}", "grpo.max_num_steps=3",
            f"grpo.num_prompts_per_step={max(1, n // generations)}", f"grpo.num_generations_per_prompt={generations}",
            f"rollout_checkpointing.snapshot_attempt_interval_s={interval_s}",
            "rollout_checkpointing.keep_latest_k=1000", "checkpointing.keep_top_k=1000",
            "rollout_recovery.in_run.timeout_s=300", *scripted_overrides(delay_s)]


def run_repeat(run_dir: Path, n: int, *, generations: int, delay_s: float, interval_s: float,
               min_saved_calls: int, timeout_s: float) -> dict[str, Any]:
    logs, audit = run_dir / "logs", run_dir / "audit"
    audit.mkdir(parents=True, exist_ok=True)
    seen: dict[str, Any] = {}

    def lose_the_replica(_elapsed: float) -> bool:
        if seen:
            return bool(read_jsonl(logs / "recoveries.jsonl"))  # the row is the measurement: then stop
        committed = [r for r in read_jsonl(logs / "snapshots.jsonl") if r.get("committed")]
        if not committed:
            return False
        row = committed[-1]
        try:
            index = json.loads((Path(row["path"]) / "gym_checkpoint.json").read_text())
        except OSError:
            return False
        pids = replica_server_pids(logs, LOST)
        if not index["turn_level"].get(LOST) or "head_server" not in pids:
            return False
        if max(saved_calls(Path(row["path"]) / "gym-instances" / LOST).values(), default=0) < min_saved_calls:
            return False  # rollouts that have finished turns to lose
        for pid in [parent_pid(pids["head_server"]), *pids.values()]:  # the actor first, then its servers
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        seen.update(at=time.time(), loadavg=os.getloadavg()[0])
        return False

    env = run_env(marker=new_marker(), pythonpath=[INSTRUMENT], extra={"BENCH_AUDIT_DIR": str(audit)})
    outcome = run_once(_args(run_dir, n, generations, delay_s, interval_s), env=env, kill_when=lose_the_replica,
                       timeout_s=timeout_s, stdout_path=run_dir / "out.txt", stderr_path=run_dir / "err.txt")
    res: dict[str, Any] = {"killed_by": outcome.killed_by, "lost_at": seen.get("at"),
                           "loadavg_at_loss": seen.get("loadavg")}
    rows = read_jsonl(logs / "recoveries.jsonl")
    if not rows:
        why = "no replica was lost (no snapshot held such rollouts in time)" if not seen else "no recovery row"
        res["error"] = f"{why}; stderr: " + (run_dir / "err.txt").read_text(errors="replace")[-2000:]
        return res
    row = rows[0]
    res.update(seconds_to_redispatch=row["seconds_to_redispatch"], seconds_to_start=row["seconds_to_start"],
               snapshot_age_s=row.get("snapshot_age_s"), action=row["action"],
               continued=len(row["continued_turn"]) + len(row["continued_prefix"]),
               restarted_from_prompt=len(row["restarted_from_prompt"]))
    res["lost_turns"] = lost_turns(row, audit, seen["at"])
    return res


def lost_turns(row: dict[str, Any], audit: Path, lost_at: float) -> list[int]:
    """Per affected rollout (the recovery row's lists): model calls its lost attempt finished before the loss,
    less those the restored snapshot kept of it."""
    finished: dict[str, int] = {}
    for path in audit.glob("*.jsonl"):
        for call in read_jsonl(path):
            if call.get("status") == 200 and call["t"] < lost_at:
                finished[call["key"]] = max(finished.get(call["key"], 0), int(call["turn"]) + 1)
    kept = saved_calls(Path(row["snapshot"])) if row.get("snapshot") else {}
    continued = set(row["continued_turn"]) | set(row["continued_prefix"])
    out = []
    for key in sorted(continued | set(row["restarted_from_prompt"])):
        saved = kept.get(key.split("-a")[0], 0) if key in continued else 0
        out.append(max(0, finished.get(key, 0) - saved))
    return out


def rows_of(results: list[dict[str, Any]], sizes: tuple[int, ...]) -> list[dict[str, Any]]:
    rows = []
    for n in sizes:
        done = [r for r in results if r["n"] == n and r.get("seconds_to_redispatch") is not None]
        lost = [x for r in done for x in r.get("lost_turns", [])]
        rows.append({
            "n": n, "runs": len(done), "of": sum(1 for r in results if r["n"] == n),
            "redispatch_s": summary(r["seconds_to_redispatch"] for r in done),
            "start_s": summary(r["seconds_to_start"] for r in done if r.get("seconds_to_start") is not None),
            "snapshot_age_s": summary(r["snapshot_age_s"] for r in done if r.get("snapshot_age_s") is not None),
            "affected": summary(len(r.get("lost_turns", [])) for r in done),
            "lost_turns": {**summary(lost), "values": [], "mean": sum(lost) / len(lost) if lost else None},
            "lost_turns_max": max(lost, default=None),
            "loadavg": summary(r["loadavg_at_loss"] for r in done if r.get("loadavg_at_loss") is not None),
        })
    return rows


def goal_of(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Every run recovered the replica (a row with a re-dispatch), and no affected rollout lost more finished turns
    than it had finished since the snapshot it came back from (the loss is bounded by the snapshot's age)."""
    done = [r for r in results if r.get("seconds_to_redispatch") is not None]
    worst = max((r["seconds_to_redispatch"] for r in done), default=None)
    return {"recovered": len(done), "runs": len(results), "worst_redispatch_s": worst,
            "met": bool(done) and len(done) == len(results)}


def verdict(goal: dict[str, Any]) -> str:
    met = "met" if goal["met"] else "NOT met"
    return (f"every run recovered the lost replica and sent a continued rollout again: {met} "
            f"({goal['recovered']} of {goal['runs']}; worst {goal['worst_redispatch_s']} s)")


def table(res: dict[str, Any]) -> str:
    head = ["N in flight", "runs", "loss → first continued rollout, s", "new replica's start, s",
            "age of the snapshot restored from, s", "rollouts affected", "finished turns lost per affected rollout",
            "load (1 min) at the loss"]
    body = [[f"{r['n']:,}", f"{r['runs']} of {r['of']}", fmt(r["redispatch_s"], digits=2), fmt(r["start_s"], digits=2),
             fmt(r["snapshot_age_s"], digits=1), fmt(r["affected"]),
             f"mean {r['lost_turns']['mean'] if r['lost_turns']['mean'] is None else round(r['lost_turns']['mean'], 2)}, "
             f"median {fmt(r['lost_turns'], digits=1)} (max {r['lost_turns_max']})", fmt(r["loadavg"], digits=1)]
            for r in res["rows"]]
    return md_table(head, body)
