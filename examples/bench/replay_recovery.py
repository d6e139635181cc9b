"""Measurement 19: rollouts on restart-only Gym servers come back by replay, against a restart from the prompt
(docs/design.md §4.8).

Every run is a real ``examples/run_grpo.py`` process on one Gym replica of the mixed setup (scripted backend,
recording trainer). Two arms, the same rows and the same command otherwise:

- ``replay``: ``examples/configs/grpo_mixed_replay_turn.yaml`` (the restart-only agent and python_sandbox
  declare themselves replayable; the model server records each rollout's finished calls);
- ``restart``: ``examples/configs/grpo_mixed_turn.yaml`` with ``allow_restart_only_gym_servers=true`` (today's
  best effort: their rollouts restart from the prompt).

The step's rows are the mixed setup's restart-only ones (the plain loop agent on Workplace, simple_agent on
python_sandbox). The scripted backend holds each row's turn ``held_turns`` (``BENCH_SCRIPTED_HOLD`` of
``instrument/sitecustomize.py``): every rollout stops with exactly that many finished turns, whatever the
machine's speed, and the run acts once every rollout waits there and ``snapshots_after_hold`` more snapshots
committed (the first to commit after that moment is not counted: its capture may precede it). Read from the
runs' records and the model-call audit (``BENCH_AUDIT_DIR``: one line per generation that reaches the backend,
with its start and end; a replayed call never does):

A. **Per restored rollout** (``prompts x generations`` rollouts, ``repeats`` times per arm): SIGKILL of the whole
   run, then the same command without the holds. *Finished turns generated again*: the relaunch's audit lines
   of the rollout's slot at a turn it had finished. *Restore to first live call*: from ``restore.json`` written
   to the start of the slot's first call past its finished turns (replay: the tools run again and the record
   answers, no backend call; restart: those turns are generated again first). The scripted backend's reply
   delay (``delay_s``) stands in for a generation's time.
B. **The snapshot with replay records**, from the same runs before the kill (every rollout held, waiting on
   the model: an idle pause) at N = ``prompts x generations`` in flight: per snapshot counted, ``pause_s`` and the
   model server's captured bytes (``captured_bytes_by_server``) from ``snapshots.jsonl``, and the model records
   on disk; bytes per recorded turn (the model server's bytes over the turns its records hold), and what the
   records add per turn against the arm without them.
C. **Capture cost per interval** (``replay_records.py``, in this process): record_calls off against on at
   ``micro_n`` episodes, one finished turn per episode per interval: what a capture costs follows the calls
   finished since the last one, not the history.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

from bench import replay_records
from bench.common import (INSTRUMENT, Log, fmt, fresh_dir, load_rows, make_log, md_table, summary, unique_user_rows,
                          user_of)
from testkit.run_harness import RunDirs, after_committed_snapshots, new_marker, read_jsonl, run_env, run_once, \
    scripted_overrides

NAME = "replay_recovery"
TITLE = "19. Replay of rollouts on restart-only servers against a restart from the prompt"
ARMS = {
    "replay": ("examples/configs/grpo_mixed_replay_turn.yaml", []),
    "restart": ("examples/configs/grpo_mixed_turn.yaml", ["rollout_recovery.allow_restart_only_gym_servers=true"]),
}
RESTART_ONLY_AGENT, SANDBOX_AGENT = "workplace_restart_only_agent", "sandbox_simple_agent"
MODEL = "nemo_gym/replica-0/policy_model"
_SLOT = re.compile(r"^(?P<group>.+)_g(?P<g>\d+)_a[0-9a-f]{32}(?:-a\d+)?$")


def measure(*, workdir: Path, repeats: int = 3, prompts: int = 128, generations: int = 4, held_turns: int = 2,
            delay_s: float = 1.0, interval_s: float = 1.0, snapshots_after_hold: int = 3, micro_n: int = 512,
            micro_turns: int = 6, micro_repeats: int = 3, timeout_s: float = 420.0,
            log: Log | None = None) -> dict[str, Any]:
    log = log or make_log("replay-recovery")
    workdir = Path(workdir).resolve()
    restored = []
    for repeat in range(repeats):
        for arm in ARMS:
            run_dir = fresh_dir(workdir / f"restore-{arm}-{repeat}")
            res = restore_repeat(run_dir, arm, prompts=prompts, generations=generations, held_turns=held_turns,
                                 delay_s=delay_s, interval_s=interval_s, snapshots=snapshots_after_hold,
                                 timeout_s=timeout_s)
            res.update(arm=arm, repeat=repeat)
            live = summary(r["to_first_live_s"] for r in res.get("rollouts", []) if r["to_first_live_s"] is not None)
            log(f"restore {arm} #{repeat}: " + (res["error"][:300] if res.get("error") else
                f"{len(res['rollouts'])} restored, generated again {sum(r['regenerated'] for r in res['rollouts'])} "
                f"turns; restore -> first live call median {live['median']} s"))
            restored.append(res)
    micro = replay_records.measure([micro_n], turns=micro_turns, moved=1.0, repeats=micro_repeats)
    config = {"prompts": prompts, "generations": generations, "held_turns": held_turns, "delay_s": delay_s,
              "interval_s": interval_s, "snapshots_after_hold": snapshots_after_hold, "micro_n": micro_n,
              "arms": {a: list(c) for a, c in ARMS.items()}}
    rows, pause_rows = restore_rows(restored), pause_rows_of(restored, held_turns)
    return {"name": NAME, "title": TITLE, "rows": rows, "pause_rows": pause_rows, "micro": micro,
            "repeats": restored, "goal": goal_of(rows, pause_rows), "config": config}


# -- the rows and the command ------------------------------------------------------------------------------
def held_rows(prompts: int, *, sandbox: bool) -> list[dict[str, Any]]:
    """``prompts`` rows of the mixed setup's restart-only agents, each user text once (a hold is keyed by
    it); with ``sandbox`` every other row is a python_sandbox one."""
    rows = unique_user_rows(load_rows("mixed_train.jsonl"))
    plain = [r for r in rows if r["agent_ref"]["name"] == RESTART_ONLY_AGENT]
    cells = [r for r in rows if r["agent_ref"]["name"] == SANDBOX_AGENT] if sandbox else []
    out = []
    while len(out) < prompts:
        source = cells if sandbox and len(out) % 2 and cells else plain
        if not source:
            raise ValueError(f"the mixed data has too few distinct restart-only rows for {prompts} prompts")
        out.append(source.pop(0))
    return out


def _args(arm: str, run_dir: Path, data: Path, prompts: int, generations: int, delay_s: float,
          interval_s: float) -> list[str]:
    config, extra = ARMS[arm]
    return ["--config", config, "policy.model_name=scripted-test-backend", "logger.plot=false",
            "logger.progress_bar=false", f"logger.log_dir={run_dir / 'logs'}",
            f"checkpointing.checkpoint_dir={run_dir / 'ckpt'}", f"data.train_data_path={data}", "data.shuffle=false",
            "grpo.max_num_steps=1", f"grpo.num_prompts_per_step={prompts}",
            f"grpo.num_generations_per_prompt={generations}",
            f"rollout_checkpointing.snapshot_attempt_interval_s={interval_s}",
            "rollout_checkpointing.keep_latest_k=1000", "rollout_checkpointing.max_consecutive_failures=1000",
            "rollout_recovery.gym_prepare_timeout_s=60", *scripted_overrides(delay_s), *extra]


def _env(run_dir: Path, audit: Path, holds: list[list[Any]] | None) -> dict[str, str]:
    extra = {"BENCH_AUDIT_DIR": str(audit)}
    if holds is not None:
        gate = run_dir / "gate"
        gate.mkdir(parents=True, exist_ok=True)
        (gate / "holds.json").write_text(json.dumps(holds))
        extra["BENCH_SCRIPTED_HOLD"] = str(gate)
    return run_env(marker=new_marker(), pythonpath=[INSTRUMENT], extra=extra)


def _held(run_dir: Path) -> int:
    """Replies waiting at a hold in the run's scripted backend (0 before it is up)."""
    import urllib.request

    url = run_dir / "gate" / "backend_url"
    if not url.exists():
        return 0
    try:
        with urllib.request.urlopen(url.read_text() + "/scripted/calls", timeout=10) as resp:
            return int(json.loads(resp.read())["held"])
    except OSError:
        return 0


def _once_all_held(run_dir: Path, expected: int, snapshots: int):
    """A kill condition: ``snapshots`` snapshots committed after every rollout waits at its hold, not counting
    the first to commit after that moment (its capture may have come before the last rollout's turn ended)."""
    dirs = RunDirs(run_dir)
    state: dict[str, Any] = {}

    def check(elapsed: float) -> bool:
        if "after" not in state:
            if _held(run_dir) < expected:
                return False
            state["at"], state["after"] = time.time(), after_committed_snapshots(dirs, snapshots + 1)
        return state["after"](elapsed)
    return check, state


# -- A: restore ------------------------------------------------------------------------------------------
def restore_repeat(run_dir: Path, arm: str, *, prompts: int, generations: int, held_turns: int, delay_s: float,
                   interval_s: float, snapshots: int, timeout_s: float) -> dict[str, Any]:
    rows = held_rows(prompts, sandbox=True)
    data = run_dir / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = _args(arm, run_dir, data, prompts, generations, delay_s, interval_s)
    holds = [[user_of(r), held_turns] for r in rows]
    kill, state = _once_all_held(run_dir, prompts * generations, snapshots)
    first = run_once(args, env=_env(run_dir, run_dir / "audit-1", holds), kill_when=kill, timeout_s=timeout_s,
                     stdout_path=run_dir / "out-1.txt", stderr_path=run_dir / "err-1.txt")
    res: dict[str, Any] = {"command": " ".join(["python", "examples/run_grpo.py", *args]), "n": prompts * generations,
                           "loadavg_at_kill": os.getloadavg()[0], "killed_by": first.killed_by}
    if first.killed_by != "group":
        res["error"] = (f"the run was not killed at the hold ({first.killed_by}, exit {first.returncode}): "
                        f"{first.tail(8)}")
        return res
    committed = [r for r in read_jsonl(run_dir / "logs" / "snapshots.jsonl") if r.get("committed")]
    res["snapshots"] = [snapshot_row(r) for r in committed[-snapshots:]]  # those taken with every rollout held
    second = run_once(args, env=_env(run_dir, run_dir / "audit-2", None), timeout_s=timeout_s,
                      stdout_path=run_dir / "out-2.txt", stderr_path=run_dir / "err-2.txt")
    restore_path = run_dir / "logs" / "restore.json"
    if second.returncode != 0 or not restore_path.exists():
        res["error"] = f"the relaunch exited {second.returncode}: {second.tail(8)}"
        return res
    restore = json.loads(restore_path.read_text())
    res.update(restored_replay=restore["restored_replay"], restarted_from_prompt=restore["restarted_from_prompt"],
               restored_turn=restore["restored_turn"], relaunch_s=second.wall_s)
    res["rollouts"] = per_rollout(run_dir, restore_path.stat().st_mtime, held_turns)
    return res


def _audit(path: Path) -> list[dict[str, Any]]:
    return [r for p in sorted(path.glob("model-*.jsonl")) for r in read_jsonl(p) if r.get("status") == 200]


def _slot(key: str) -> tuple[str, int] | None:
    m = _SLOT.match(key)
    return (m["group"], int(m["g"])) if m else None


def per_rollout(run_dir: Path, restored_at: float, held_turns: int) -> list[dict[str, Any]]:
    """Per rollout slot the hold stopped in the first run: the turns it had finished, those the relaunch
    generated again, and seconds from the restore to the start of its first call past them."""
    finished: dict[tuple[str, int], set[int]] = {}
    for line in _audit(run_dir / "audit-1"):
        slot = _slot(line["key"])
        if slot is not None:
            finished.setdefault(slot, set()).add(int(line["turn"]))
    again: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for line in _audit(run_dir / "audit-2"):
        slot = _slot(line["key"])
        if slot is not None:
            again.setdefault(slot, []).append(line)
    out = []
    for slot, turns in sorted(finished.items()):
        if len(turns) < held_turns:
            continue  # not one the hold stopped (it cannot be: every row is held)
        lines = again.get(slot, [])
        live = [ln["t0"] for ln in lines if int(ln["turn"]) >= len(turns)]
        out.append({"slot": f"{slot[0]}_g{slot[1]}", "finished": len(turns),
                    "regenerated": sum(1 for ln in lines if int(ln["turn"]) in turns),
                    "to_first_live_s": round(min(live) - restored_at, 4) if live else None})
    return out


def restore_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for arm in ARMS:
        done = [r for r in results if r["arm"] == arm and not r.get("error")]
        rollouts = [x for r in done for x in r["rollouts"]]
        regen = [x["regenerated"] for x in rollouts]
        rows.append({
            "arm": arm, "runs": len(done), "of": sum(1 for r in results if r["arm"] == arm),
            "rollouts": len(rollouts), "finished": summary(x["finished"] for x in rollouts),
            "regenerated": summary(regen), "regenerated_mean": sum(regen) / len(regen) if regen else None,
            "regenerated_max": max(regen, default=None),
            "to_first_live_s": summary(x["to_first_live_s"] for x in rollouts if x["to_first_live_s"] is not None),
            "by_replay": summary(r["restored_replay"] for r in done),
            "from_prompt": summary(r["restarted_from_prompt"] for r in done),
            "loadavg": summary(r["loadavg_at_kill"] for r in done),
        })
    return rows


# -- B: the snapshot at N in flight ---------------------------------------------------------------------
def snapshot_row(row: dict[str, Any]) -> dict[str, Any]:
    """What one committed snapshot (a ``snapshots.jsonl`` row) cost, and the model records it wrote."""
    return {"pause_s": row["pause_s"], "captured_bytes": row.get("captured_bytes"),
            "model_bytes": (row.get("captured_bytes_by_server") or {}).get(MODEL), "replayed": row.get("replayed", 0),
            "unsaved": row.get("unsaved", 0), **records_on_disk(Path(row["path"]))}


def records_on_disk(snapshot: Path) -> dict[str, int]:
    """The model server's records in a snapshot directory: bytes, and the finished calls they hold."""
    size = calls = 0
    for path in snapshot.glob("gym-instances/*/*/gym/model/*/records-*.jsonl"):
        size += path.stat().st_size
        calls += sum(len(json.loads(line).get("calls", [])) for line in path.read_text().splitlines() if line)
    return {"model_records_bytes": size, "recorded_calls": calls}


def pause_rows_of(results: list[dict[str, Any]], held_turns: int) -> list[dict[str, Any]]:
    rows = []
    for arm in ARMS:
        done = [r for r in results if r["arm"] == arm and r.get("snapshots")]
        snaps = [s for r in done for s in r["snapshots"]]
        per_turn = [s["model_bytes"] / s["recorded_calls"] for s in snaps if s["model_bytes"] and s["recorded_calls"]]
        n = max((r["n"] for r in results if r["arm"] == arm), default=0)
        rows.append({"arm": arm, "n": n, "runs": len(done), "snapshots": len(snaps),
                     "pause_s": summary(s["pause_s"] for s in snaps),
                     "captured_bytes": summary(s["captured_bytes"] for s in snaps if s["captured_bytes"] is not None),
                     "model_bytes": summary(s["model_bytes"] for s in snaps if s["model_bytes"] is not None),
                     "recorded_calls": summary(s["recorded_calls"] for s in snaps),
                     "model_records_bytes": summary(s["model_records_bytes"] for s in snaps),
                     "bytes_per_recorded_turn": summary(per_turn), "turns_held": n * held_turns,
                     "loadavg": summary(r["loadavg_at_kill"] for r in done)})
    by_arm = {r["arm"]: r for r in rows}
    replay, restart = by_arm["replay"]["model_bytes"]["median"], by_arm["restart"]["model_bytes"]["median"]
    if replay is not None and restart is not None and by_arm["replay"]["turns_held"]:
        by_arm["replay"]["added_bytes_per_turn"] = (replay - restart) / by_arm["replay"]["turns_held"]
    return rows


# -- verdict and tables ---------------------------------------------------------------------------------
def goal_of(rows: list[dict[str, Any]], pause_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Replay generates no finished turn again and reaches each rollout's first live call sooner than a restart
    from the prompt; every run of both arms completed."""
    by_arm = {r["arm"]: r for r in rows}
    replay, restart = by_arm.get("replay", {}), by_arm.get("restart", {})
    complete = all(r["runs"] == r["of"] and r["rollouts"] for r in rows) and all(p["snapshots"] for p in pause_rows)
    sooner = None
    if (replay.get("to_first_live_s") or {}).get("median") is not None and \
            (restart.get("to_first_live_s") or {}).get("median") is not None:
        sooner = replay["to_first_live_s"]["median"] < restart["to_first_live_s"]["median"]
    return {"complete": complete, "replay_regenerated_max": replay.get("regenerated_max"),
            "restart_regenerated_mean": restart.get("regenerated_mean"), "replay_sooner": sooner,
            "met": bool(complete and replay.get("regenerated_max") == 0 and sooner)}


def verdict(goal: dict[str, Any]) -> str:
    met = "met" if goal["met"] else "NOT met"
    return (f"replay generates no finished turn again (worst {goal['replay_regenerated_max']}; a restart from the "
            f"prompt: {goal['restart_regenerated_mean']} per rollout on average) and reaches the first live call "
            f"sooner: {met} (every run complete: {goal['complete']})")


def _kb(s: dict[str, Any]) -> str:
    return fmt(s, scale=1 / 1024, digits=1)


def table(res: dict[str, Any]) -> str:
    a = md_table(
        ["arm", "runs", "rollouts restored", "by replay / from the prompt (per run)", "finished turns per rollout",
         "generated again per rollout: mean, max", "restore → first live call, s", "load (1 min) at the kill"],
        [[r["arm"], f"{r['runs']} of {r['of']}", r["rollouts"], f"{fmt(r['by_replay'])} / {fmt(r['from_prompt'])}",
          fmt(r["finished"]), f"{'—' if r['regenerated_mean'] is None else round(r['regenerated_mean'], 2)}, "
          f"{r['regenerated_max']}", fmt(r["to_first_live_s"], digits=2), fmt(r["loadavg"], digits=1)]
         for r in res["rows"]])
    b = md_table(
        ["arm", "N in flight", "snapshots counted", "pause, s", "captured KB (all)", "model server KB",
         "recorded calls",
         "model records on disk, KB", "bytes per recorded turn", "added per turn vs no records, B", "load (1 min)"],
        [[r["arm"], r["n"], f"{r['snapshots']} ({r['runs']} runs)", fmt(r["pause_s"], digits=3),
          _kb(r["captured_bytes"]), _kb(r["model_bytes"]), fmt(r["recorded_calls"]), _kb(r["model_records_bytes"]),
          fmt(r["bytes_per_recorded_turn"]), "—" if r.get("added_bytes_per_turn") is None else
          f"{r['added_bytes_per_turn']:,.0f}", fmt(r["loadavg"], digits=1)] for r in res["pause_rows"]])
    c = replay_records.table(res["micro"])
    return "\n\n".join([a, b, f"Capture cost per interval (record_calls off / on, {res['config']['micro_n']} "
                               "episodes, one finished turn each per interval):", c])
