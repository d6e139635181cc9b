"""Measurement 14: in-run recovery of a Gym server and of a Gym replica (docs/design.md §5.12).

Each repeat is one real ``examples/run_grpo.py`` process per kind of loss, on
``examples/configs/grpo_workplace_two_replicas_turn.yaml`` (scripted backend,
recording trainer, two replicas of one shard). Once step 1 is trained and a
committed snapshot holds turn-level rollouts on ``nemo_gym/replica-1`` (one of them with at
least ``min_saved_calls`` finished model calls: there are turns to lose), the
benchmark SIGKILLs either its Workplace resources server (``server``) or its
``NemoGym`` actor together with every server under it (``replica``), and the run
goes on by itself to the end.

Read from the run's own records and the model-call audit
(``bench/instrument/sitecustomize.py``: one line per finished model call, with
its capture key, turn and wall time):

- seconds from the loss noticed to the first continued rollout sent to Gym again
  (``recoveries.jsonl``: ``seconds_to_redispatch``) beside the new replica's own
  start (``seconds_to_start``);
- per rollout the recovery continued: model calls (finished turns) the lost attempt
  had made, the calls its saved state kept (the snapshot's agent records), and so
  the turns regenerated now (made - kept) against a restart from the prompt (made);
- replica-0's finished model calls per second in the ``window_s`` before the loss
  against during the recovery (loss to redispatch): the other replica keeps working.
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

NAME = "gym_recovery"
TITLE = "14. In-run recovery of a Gym server and of a Gym replica"
CONFIG = "examples/configs/grpo_workplace_two_replicas_turn.yaml"
LOST, OTHER = "nemo_gym/replica-1", "nemo_gym/replica-0"
KINDS = (("server", "resources server SIGKILLed"), ("replica", "replica actor + servers SIGKILLed"))


def measure(*, repeats: int, workdir: Path, steps: int = 3, prompts: int = 8, generations: int = 4,
            delay_s: float = 0.5, interval_s: float = 0.5, window_s: float = 2.0, min_saved_calls: int = 2,
            log: Log | None = None) -> dict[str, Any]:
    log = log or make_log("gym-recovery")
    results = []
    for repeat in range(repeats):
        for kind, _ in KINDS:
            run_dir = fresh_dir(Path(workdir).resolve() / f"{kind}-{repeat}")
            res = run_repeat(run_dir, kind, steps=steps, prompts=prompts, generations=generations,
                             delay_s=delay_s, interval_s=interval_s, window_s=window_s,
                             min_saved_calls=min_saved_calls)
            res.update(kind=kind, repeat=repeat)
            log(f"{kind} #{repeat}: exit {res['returncode']}, redispatch {res.get('seconds_to_redispatch')} s, "
                f"start {res.get('seconds_to_start')} s, continued {res.get('continued')}")
            results.append(res)
    rows = rows_of(results)
    return {"name": NAME, "title": TITLE, "rows": rows, "repeats": results, "goal": goal_of(rows, results),
            "config": {"config": CONFIG, "steps": steps, "prompts": prompts, "generations": generations,
                       "delay_s": delay_s, "interval_s": interval_s, "window_s": window_s,
                       "min_saved_calls": min_saved_calls}}


def _args(run_dir: Path, steps: int, prompts: int, generations: int, delay_s: float, interval_s: float) -> list[str]:
    return ["--config", CONFIG, "policy.model_name=scripted-test-backend", "logger.plot=false",
            f"logger.log_dir={run_dir / 'logs'}", f"checkpointing.checkpoint_dir={run_dir / 'ckpt'}",
            f"grpo.max_num_steps={steps}", f"grpo.num_prompts_per_step={prompts}",
            f"grpo.num_generations_per_prompt={generations}",
            f"rollout_checkpointing.snapshot_attempt_interval_s={interval_s}",
            "rollout_checkpointing.keep_latest_k=1000", "checkpointing.keep_top_k=1000",
            *scripted_overrides(delay_s)]


def run_repeat(run_dir: Path, kind: str, *, steps: int, prompts: int, generations: int, delay_s: float,
               interval_s: float, window_s: float, min_saved_calls: int = 2) -> dict[str, Any]:
    logs, audit = run_dir / "logs", run_dir / "audit"
    audit.mkdir(parents=True, exist_ok=True)
    seen: dict[str, Any] = {}

    def lose_a_part(_elapsed: float) -> bool:
        if seen:
            return False
        if not read_jsonl(logs / "metrics.jsonl"):
            return False  # step 1 trained first: replica-0 has a "before"
        committed = [r for r in read_jsonl(logs / "snapshots.jsonl") if r.get("committed")]
        if not committed or committed[-1]["step"] < 1:  # the newest: what the recovery restores from
            return False
        row = committed[-1]
        index = json.loads((Path(row["path"]) / "gym_checkpoint.json").read_text())
        pids = replica_server_pids(logs, LOST)
        if not index["turn_level"].get(LOST) or "workplace_assistant" not in pids:
            return False
        if max(saved_calls(Path(row["path"]) / "gym-instances" / LOST).values(), default=0) < min_saved_calls:
            return False  # a snapshot of rollouts that have finished turns to lose
        # a replica: its actor first (a server dying before it would be a server's loss), then its servers
        hit = [pids["workplace_assistant"]] if kind == "server" else [parent_pid(pids["head_server"]), *pids.values()]
        for pid in hit:
            os.kill(pid, signal.SIGKILL)
        seen.update(at=time.time(), snapshot=row["path"])
        return False

    env = run_env(marker=new_marker(), pythonpath=[INSTRUMENT], extra={"BENCH_AUDIT_DIR": str(audit)})
    outcome = run_once(_args(run_dir, steps, prompts, generations, delay_s, interval_s), env=env,
                       kill_when=lose_a_part, timeout_s=400, stdout_path=run_dir / "out.txt",
                       stderr_path=run_dir / "err.txt")
    res: dict[str, Any] = {"returncode": outcome.returncode, "lost_at": seen.get("at")}
    rows = read_jsonl(logs / "recoveries.jsonl")
    if not rows:
        why = "no part was lost (no snapshot held such rollouts in time)" if not seen else "no recovery row"
        res["error"] = f"{why}; stderr: " + (run_dir / "err.txt").read_text(errors="replace")[-2000:]
        return res
    row = rows[0]
    res.update(seconds_to_redispatch=row["seconds_to_redispatch"], seconds_to_start=row["seconds_to_start"],
               action=row["action"], continued=len(row["continued_turn"]) + len(row["continued_prefix"]),
               restarted_from_prompt=len(row["restarted_from_prompt"]))
    calls = [c for path in audit.glob("*.jsonl") for c in read_jsonl(path) if c.get("status") == 200]
    kept = saved_calls(Path(row["snapshot"])) if row["snapshot"] else {}
    made = {}
    for key in row["continued_turn"] + row["continued_prefix"]:
        made[key] = sum(1 for c in calls if c["key"] == key)
    res["per_rollout"] = [{"made": made[k], "kept": kept.get(k.split("-a")[0], 0)} for k in made]
    trained = _trained_on(run_dir / "ckpt", steps)
    other = {rid for rid, iid in trained.items() if iid == OTHER}
    lost_at = row["time"]
    until = lost_at + (row["seconds_to_redispatch"] or 0.0)
    before = sum(1 for c in calls if c["key"] in other and lost_at - window_s <= c["t"] < lost_at) / window_s
    during = (sum(1 for c in calls if c["key"] in other and lost_at <= c["t"] < until) / (until - lost_at)
              if until > lost_at else None)
    res.update(other_calls_per_s_before=round(before, 2),
               other_calls_per_s_during=None if during is None else round(during, 2))
    return res


def _trained_on(ckpt: Path, steps: int) -> dict[str, str]:
    """Trained rollout id -> the replica that ran it (the final trainer step's recording)."""
    path = ckpt / f"step_{steps}" / "recording_trainer.json"
    if not path.exists():
        return {}
    return {rid: iid for b in json.loads(path.read_text())["batches"] for rid, iid in b["gym_instances"].items()}


def rows_of(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for kind, label in KINDS:
        done = [r for r in results if r["kind"] == kind and r.get("seconds_to_redispatch") is not None]
        per = [p for r in done for p in r.get("per_rollout", [])]
        rows.append({
            "kind": kind, "label": label, "runs": len(done),
            "exit_codes": sorted({r["returncode"] for r in results if r["kind"] == kind}),
            "redispatch_s": summary(r["seconds_to_redispatch"] for r in done),
            "start_s": summary(r["seconds_to_start"] for r in done if r.get("seconds_to_start") is not None),
            "continued": sum(r["continued"] for r in done),
            "restarted_from_prompt": sum(r["restarted_from_prompt"] for r in done),
            "regenerated_turns": summary(p["made"] - p["kept"] for p in per),
            "from_prompt_turns": summary(p["made"] for p in per),
            "other_before": summary(r["other_calls_per_s_before"] for r in done),
            "other_during": summary(r["other_calls_per_s_during"] for r in done
                                    if r.get("other_calls_per_s_during") is not None),
        })
    return rows


REDISPATCH_GOAL_S = 10.0


def goal_of(rows: list[dict[str, Any]], results: list[dict[str, Any]]) -> dict[str, Any]:
    """Every run finished by itself, the first continued rollout went out within ``REDISPATCH_GOAL_S`` of the
    loss, and a continued rollout never regenerated more turns than a restart from its prompt would."""
    done = [r for r in results if r.get("seconds_to_redispatch") is not None]
    worst = max((r["seconds_to_redispatch"] for r in done), default=None)
    return {"redispatch_within_s": REDISPATCH_GOAL_S, "worst_redispatch_s": worst,
            "met": bool(done) and len(done) == len(results) and all(r["returncode"] == 0 for r in results)
            and worst <= REDISPATCH_GOAL_S
            and all(p["made"] - p["kept"] <= p["made"] for r in done for p in r.get("per_rollout", []))}


def verdict(goal: dict[str, Any]) -> str:
    met = "met" if goal["met"] else "NOT met"
    return (f"every run went on by itself and the first continued rollout was sent again within "
            f"{goal['redispatch_within_s']:g} s of the loss: {met} (worst {goal['worst_redispatch_s']} s)")


def table(res: dict[str, Any]) -> str:
    head = ["loss", "runs (exit)", "loss → first continued rollout, s", "new replica's start, s",
            "continued / from prompt", "turns regenerated per continued rollout: now / restart from prompt",
            "replica-0 model calls/s: before / during"]
    body = [[r["label"], f"{r['runs']} ({', '.join(map(str, r['exit_codes']))})", fmt(r["redispatch_s"], digits=2),
             fmt(r["start_s"], digits=2), f"{r['continued']} / {r['restarted_from_prompt']}",
             f"{fmt(r['regenerated_turns'], digits=1)} / {fmt(r['from_prompt_turns'], digits=1)}",
             f"{fmt(r['other_before'], digits=1)} / {fmt(r['other_during'], digits=1)}"] for r in res["rows"]]
    return md_table(head, body)
