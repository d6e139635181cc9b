"""Measurement 16: in-run recovery of the generation worker (docs/design.md §5.12).

Each repeat is one real ``examples/run_grpo.py`` process per recovery level, on
``examples/configs/grpo_workplace_two_replicas_turn.yaml`` with the embedded model (warm-started once into
a cache shared by the repeats) on the torch worker, replies decoded to the token limit
(``policy.generation.ignore_eos``) so model calls are in flight. Once a committed snapshot is the newest
(at ``prefix``: one holding a generation cut), the benchmark SIGKILLs the generation worker's process and
the run goes on by itself to the end. A loss that finds no call to send again (at ``prefix``: none from its
cut), because the snapshot's calls ended between its commit and the kill, measures nothing: the new worker
is lost again after the next such snapshot, up to ``MAX_LOSSES`` times and only while a step is left after
the current one; the first recovery that sent calls again is the one measured.

Read from the run's own records:

- seconds from the loss to the first model call the model servers sent again (``recoveries.jsonl``:
  ``seconds_to_redispatch``) beside the new worker's start (``seconds_to_start``);
- the calls sent again, and at ``prefix`` those that continued from a cut of themselves: the tokens the
  cut kept against the tokens the new worker decoded after it (``metrics.jsonl``'s
  ``prefix_continuations``: the reply's tokens less the cut's). The tail includes what the lost worker had
  decoded past the cut (regenerated) and the rest of the reply, so it bounds the regenerated tokens from
  above; at ``turn`` every call sent again is decoded from its first token;
- rollouts sent back to their prompt (the goal: none).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from bench.common import Log, fmt, fresh_dir, make_log, md_table, summary
from testkit.run_harness import generation_worker_pid, new_marker, read_jsonl, run_env, run_once

NAME = "generation_recovery"
TITLE = "16. In-run recovery of the generation worker"
CONFIG = "examples/configs/grpo_workplace_two_replicas_turn.yaml"
LEVELS = ("turn", "prefix")
MAX_LOSSES = 3


def measure(*, repeats: int, workdir: Path, steps: int = 3, prompts: int = 4, generations: int = 4,
            interval_s: float = 0.3, max_new_tokens: int = 96, warm_start_steps: int = 20,
            levels: tuple[str, ...] = LEVELS, log: Log | None = None,
            run_env_kw: dict[str, Any] | None = None) -> dict[str, Any]:
    """``run_env_kw``: more of each run's environment (``testkit.run_harness.run_env``'s keywords): the smoke
    test's decode hold (``tests/functional/decode_hold``), so its one short run has calls in flight at the
    loss on any machine; the measurement itself runs without it."""
    log = log or make_log("generation-recovery")
    workdir = Path(workdir).resolve()
    cache = workdir / "model_cache"
    cache.mkdir(parents=True, exist_ok=True)
    results = []
    for repeat in range(repeats):
        for level in levels:
            run_dir = fresh_dir(workdir / f"{level}-{repeat}")
            res = run_repeat(run_dir, level, cache=cache, steps=steps, prompts=prompts, generations=generations,
                             interval_s=interval_s, max_new_tokens=max_new_tokens, warm_start_steps=warm_start_steps,
                             run_env_kw=run_env_kw)
            res.update(level=level, repeat=repeat)
            log(f"{level} #{repeat}: exit {res['returncode']}, redispatch {res.get('seconds_to_redispatch')} s, "
                f"start {res.get('seconds_to_start')} s, resent {res.get('calls_resent')}, "
                f"kept {res.get('tokens_kept')} tokens")
            results.append(res)
    rows = rows_of(results)
    return {"name": NAME, "title": TITLE, "rows": rows, "repeats": results, "goal": goal_of(results),
            "config": {"config": CONFIG, "steps": steps, "prompts": prompts, "generations": generations,
                       "interval_s": interval_s, "max_new_tokens": max_new_tokens,
                       "warm_start_steps": warm_start_steps}}


def _args(run_dir: Path, level: str, cache: Path, steps: int, prompts: int, generations: int, interval_s: float,
          max_new_tokens: int, warm_start_steps: int) -> list[str]:
    return ["--config", CONFIG, "logger.plot=false", f"policy.cache_dir={cache}",
            f"policy.warm_start.steps={warm_start_steps}", "policy.generation.ignore_eos=true",
            f"policy.generation.max_new_tokens={max_new_tokens}",
            f"logger.log_dir={run_dir / 'logs'}", f"checkpointing.checkpoint_dir={run_dir / 'ckpt'}",
            f"rollout_recovery.target_level={level}",
            f"grpo.max_num_steps={steps}", f"grpo.num_prompts_per_step={prompts}",
            f"grpo.num_generations_per_prompt={generations}", "grpo.val_period=0", "grpo.val_at_start=false",
            f"rollout_checkpointing.snapshot_attempt_interval_s={interval_s}",
            "rollout_checkpointing.keep_latest_k=1000", "checkpointing.keep_top_k=1000"]


def run_repeat(run_dir: Path, level: str, *, cache: Path, steps: int, prompts: int, generations: int,
               interval_s: float, max_new_tokens: int, warm_start_steps: int,
               run_env_kw: dict[str, Any] | None = None) -> dict[str, Any]:
    logs = run_dir / "logs"
    losses: list[dict[str, Any]] = []  # each loss: when, the pid, the snapshot it followed

    def measured(row: dict[str, Any]) -> bool:
        return row["calls_resent"] > 0 and (level == "turn" or row["calls_continued_from_cut"] > 0)

    def lose_the_worker(_elapsed: float) -> bool:
        rows = read_jsonl(logs / "recoveries.jsonl")
        if len(losses) >= MAX_LOSSES or len(rows) < len(losses) or any(measured(r) for r in rows):
            return False  # enough, a recovery under way, or one measured
        if len(read_jsonl(logs / "metrics.jsonl")) >= steps - 1:
            return False  # a loss in the last step's tail may end with the run, unrecovered
        committed = [r for r in read_jsonl(logs / "snapshots.jsonl") if r.get("committed")]
        if not committed or (level == "prefix" and not committed[-1].get("cuts")):
            return False
        if any(loss["after"] == committed[-1]["path"] for loss in losses):
            return False  # a newer snapshot each time
        pid = generation_worker_pid(logs)
        if pid is None or any(loss["pid"] == pid for loss in losses):
            return False
        os.kill(pid, signal.SIGKILL)
        losses.append({"at": time.time(), "pid": pid, "after": committed[-1]["path"]})
        return False

    outcome = run_once(_args(run_dir, level, cache, steps, prompts, generations, interval_s, max_new_tokens,
                             warm_start_steps),
                       env=run_env(marker=new_marker(), **(run_env_kw or {})), kill_when=lose_the_worker, timeout_s=600,
                       stdout_path=run_dir / "out.txt", stderr_path=run_dir / "err.txt")
    res: dict[str, Any] = {"returncode": outcome.returncode, "losses": len(losses)}
    rows = read_jsonl(logs / "recoveries.jsonl")
    row = next((r for r in rows if measured(r)), None)
    if row is None:
        why = ("the worker was not lost (no snapshot in time)" if not losses
               else f"{len(losses)} loss(es), {len(rows)} recovery row(s), none sent a call again")
        res["error"] = f"{why}; stderr: " + (run_dir / "err.txt").read_text(errors="replace")[-2000:]
        return res
    res.update({k: row[k] for k in ("seconds_to_redispatch", "seconds_to_start", "calls_resent",
                                    "calls_continued_from_cut", "tokens_kept")},
               restarted_from_prompt=sum(len(r["restarted_from_prompt"]) for r in rows))
    calls = [c for m in read_jsonl(logs / "metrics.jsonl") for c in m.get("prefix_continuations", [])]
    own = [c for c in calls if c["discarded"] is None and c["call_id"].rsplit(".", 1)[0] == c["rollout_id"]]
    res["per_call"] = [{"kept": c["token_count"], "tail": c["generation_tokens"] - c["token_count"]} for c in own]
    return res


def rows_of(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for level in [lv for lv in LEVELS if any(r["level"] == lv for r in results)]:
        done = [r for r in results if r["level"] == level and r.get("seconds_to_redispatch") is not None]
        per = [p for r in done for p in r.get("per_call", [])]
        rows.append({
            "level": level, "runs": len(done),
            "exit_codes": sorted({r["returncode"] for r in results if r["level"] == level}),
            "redispatch_s": summary(r["seconds_to_redispatch"] for r in done),
            "start_s": summary(r["seconds_to_start"] for r in done),
            "resent": sum(r["calls_resent"] for r in done),
            "from_cut": sum(r["calls_continued_from_cut"] for r in done),
            "kept": summary(p["kept"] for p in per),
            "tail": summary(p["tail"] for p in per),
            "restarted_from_prompt": sum(r["restarted_from_prompt"] for r in done),
        })
    return rows


REDISPATCH_GOAL_S = 30.0


def goal_of(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Every run finished by itself with no rollout back at its prompt, and the first call was sent again
    within ``REDISPATCH_GOAL_S`` of the loss (the new worker's start is most of it)."""
    done = [r for r in results if r.get("seconds_to_redispatch") is not None]
    worst = max((r["seconds_to_redispatch"] for r in done), default=None)
    return {"redispatch_within_s": REDISPATCH_GOAL_S, "worst_redispatch_s": worst,
            "met": bool(done) and len(done) == len(results) and all(r["returncode"] == 0 for r in results)
            and all(r["restarted_from_prompt"] == 0 for r in done) and worst <= REDISPATCH_GOAL_S}


def verdict(goal: dict[str, Any]) -> str:
    met = "met" if goal["met"] else "NOT met"
    return (f"every run went on by itself, no rollout went back to its prompt, and the first model call was sent "
            f"again within {goal['redispatch_within_s']:g} s of the loss: {met} "
            f"(worst {goal['worst_redispatch_s']} s)")


def table(res: dict[str, Any]) -> str:
    head = ["level", "runs (exit)", "loss → first call sent again, s", "new worker's start, s",
            "calls sent again / from their own cut", "per call from a cut: tokens kept / decoded after the restart",
            "rollouts back at their prompt"]
    body = [[r["level"], f"{r['runs']} ({', '.join(map(str, r['exit_codes']))})", fmt(r["redispatch_s"], digits=2),
             fmt(r["start_s"], digits=2), f"{r['resent']} / {r['from_cut']}",
             f"{fmt(r['kept'], digits=0)} / {fmt(r['tail'], digits=0)}", r["restarted_from_prompt"]]
            for r in res["rows"]]
    return md_table(head, body)
