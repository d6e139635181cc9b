"""Measurement 11: work lost per preemption, with the final snapshot against before it, and seconds
from SIGTERM to exit (issue 29; docs/design.md §5.11).

Before the stop signals, a SIGTERM killed the run without a snapshot, so its relaunch restored the
newest *periodic* snapshot: the same as a SIGKILL of the run's whole process group at that moment.
Now a SIGTERM to the driver closes admission, takes one final snapshot through the normal path (its
``snapshots.jsonl`` row: ``requested: SIGTERM``), publishes it and exits 143.

Part 1, work lost per preemption. Real runs of ``examples/run_grpo.py`` on
``grpo_workplace_turn.yaml`` (turn level, the scripted backend with ``delay_s`` per reply, so every
rollout takes three model calls, the recording trainer), built and analysed by ``bench/work_lost.py``
(``run_experiment``, ``analyse``): for each seed a stop moment ``random.Random(seed).uniform(*window)``
seconds after step 1's metrics line (the same moment for every interval and behaviour of a seed), then
the same command again to completion. Behaviours:

- ``before`` (what a SIGTERM did before): SIGKILL of the run's process group at that moment;
- ``final snapshot``: SIGTERM to the driver alone (as ``kill`` or Slurm's ``--signal=B:TERM`` sends
  it), wait for its exit (status 143 expected, one ``stopped by SIGTERM`` line).

each at every snapshot interval in ``intervals`` (the main job's 5 s, and 120 s, the interval upstream's
SWE configs use; at 120 s no periodic snapshot lands in a short step 2, so before the final snapshot
every rollout in flight restarted from its prompt). Counted from the policy model server's audit
(``bench/instrument/sitecustomize.py``): *finished turns regenerated* = model calls that had finished
before the stop and were generated again by the relaunch (their tokens likewise); *all regenerated*
(``work_lost.analyse``) also counts calls that finished after the signal, while the run was stopping,
and were then redone. Per in-flight rollout: over the rollouts of step 2 (all dispatched at once).

Part 2, seconds from SIGTERM to exit at N rollouts in flight. One Gym replica, ``N = prompts x
generations`` rollouts dispatched at once (step 1), the scripted backend replying after a long delay
(``exit_delay_s``, per N) so they all stay in flight, periodic snapshots off. Once ``fill`` x N
rollouts have a finished model call (the audit: each then has a turn to save), the driver gets
SIGTERM; measured: signal to the final snapshot's row, signal to the driver's exit, the row's
``pause_s``, ``persist_s``, ``saved``/``unsaved``/``not_admitted``, the exit status, the stop line,
processes of the run alive at the driver's exit and seconds until none is (``testkit.run_harness``'s
marker; any still there after 30 s are killed and reported).

The 1-minute load average is recorded at every stop and shown beside each row.
"""

from __future__ import annotations

import math
import os
import random
import signal
import subprocess
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

from bench import work_lost
from bench.common import INSTRUMENT, SCRIPTED, Log, fmt, fresh_dir, make_log, md_table, summary
from testkit.run_harness import (
    MARKER_ENV,
    JsonlFollower,
    RunDirs,
    RunOutcome,
    kill_group,
    new_marker,
    processes_with_marker,
    run_env,
    run_once,
    scripted_overrides,
)

NAME = "preemption"
TITLE = "11. Work lost per preemption (final snapshot against before it) and seconds from SIGTERM to exit"
CONFIG = "examples/configs/grpo_workplace_turn.yaml"
SETUP = "workplace"  # work_lost.SETUPS: the same config
BEFORE, FINAL = "before", "final snapshot"
BEHAVIOURS = {BEFORE: "SIGKILL of the process group (restore from the newest periodic snapshot)",
              FINAL: "SIGTERM to the driver (final snapshot)"}
MAIN_JOB_INTERVAL_S = 5.0  # the embedded default's rollout_checkpointing.snapshot_attempt_interval_s
SIGTERM_STATUS = 128 + signal.SIGTERM
GRACE_S = 25.0  # rollout_checkpointing.stop_grace_s's default
POLL_S = 0.02


# -- stopping a run ------------------------------------------------------------------------------------
def stopper(how: str, grace_s: float = GRACE_S, log_dir: Callable[[list[str]], Path] | None = None
            ) -> work_lost.Stopper:
    """A ``work_lost.Stopper``: ``how`` = ``sigkill`` (the process group) or ``sigterm`` (the driver alone,
    then wait up to the grace + 60 s for its exit)."""

    def stop(args: list[str], env: dict[str, str], out_path: Path, stop_when: Callable[[float], bool],
             timeout_s: float) -> tuple[RunOutcome, dict[str, Any]]:
        logs = log_dir(args) if log_dir is not None else _log_dir(args)
        return run_and_stop(args, env, out_path, stop_when, timeout_s, how=how, grace_s=grace_s, logs=logs)

    return stop


def _log_dir(args: list[str]) -> Path:
    return Path(next(a.split("=", 1)[1] for a in args if a.startswith("logger.log_dir=")))


def run_and_stop(args: list[str], env: dict[str, str], out_path: Path, stop_when: Callable[[float], bool],
                 timeout_s: float, *, how: str, grace_s: float, logs: Path) -> tuple[RunOutcome, dict[str, Any]]:
    """``testkit.run_harness.run_once``, stopping the run once ``stop_when(elapsed)`` holds: SIGKILL to the
    group, or SIGTERM to the driver and a wait for its exit. The info: when the signal went, the driver's exit
    and status, the final snapshot row and when it appeared, the stop line, what was left."""
    if how not in ("sigkill", "sigterm"):
        raise ValueError(f"how={how!r}: sigkill or sigterm")
    env = dict(env)
    marker = env.setdefault(MARKER_ENV, new_marker())
    snaps = JsonlFollower(Path(logs) / "snapshots.jsonl")
    info: dict[str, Any] = {"how": how}

    def stop(proc: subprocess.Popen) -> str:
        info["loadavg_1m"] = os.getloadavg()[0]
        snaps.poll()
        seen, t0 = len(snaps.items), time.monotonic()
        if how == "sigkill":
            kill_group(proc)
            proc.wait(timeout=60)
        else:
            os.kill(proc.pid, signal.SIGTERM)
            info.update(_wait_for_exit(proc, snaps, seen, t0, grace_s + 60.0))
        info["exit_s"] = time.monotonic() - t0
        info["alive_at_exit"] = len(processes_with_marker(marker))
        return "group" if how == "sigkill" else "SIGTERM"

    outcome = run_once(args, env=env, stdout_path=out_path, stderr_path=out_path, kill_when=stop_when, stop=stop,
                       timeout_s=timeout_s, poll_s=POLL_S)
    info.setdefault("alive_at_exit", 0)
    info.update(returncode=outcome.returncode, signalled_at=outcome.killed_at, leftover=list(outcome.leftover),
                gone_after_exit_s=outcome.cleanup_s)
    if how == "sigterm" and outcome.killed_by == "SIGTERM":
        text = Path(out_path).read_text(errors="replace")
        lines = [line for line in text.splitlines() if line.startswith("stopped by")]
        info["stop_lines"] = lines
        info["status_ok"] = outcome.returncode == SIGTERM_STATUS and len(lines) == 1
        snaps.poll()
        # a failed final attempt is tried again within the grace: the row that counts is the committed one
        finals = [s for _, s in snaps.items if s.get("requested") == "SIGTERM"]
        info["final_attempts"] = len(finals)
        info["final_row"] = next((s for s in finals if s.get("committed")), finals[-1] if finals else None)
    return outcome, info


def _wait_for_exit(proc: subprocess.Popen, snaps: JsonlFollower, seen: int, t0: float,
                   limit_s: float) -> dict[str, Any]:
    """Wait for the driver after the SIGTERM, noting when the final snapshot's row appeared."""
    out: dict[str, Any] = {"final_row_s": None, "hung": False}

    def final_written() -> bool:  # the committed final row (a failed attempt is tried again)
        snaps.poll()
        return any(s.get("requested") == "SIGTERM" and s.get("committed") for _, s in snaps.items[seen:])

    while proc.poll() is None:
        if out["final_row_s"] is None and final_written():
            out["final_row_s"] = time.monotonic() - t0
        if time.monotonic() - t0 > limit_s:
            out["hung"] = True
            kill_group(proc)
            break
        time.sleep(POLL_S)
    if out["final_row_s"] is None and final_written():
        out["final_row_s"] = time.monotonic() - t0  # written in the last poll interval before the exit
    return out


# -- part 1: work lost per preemption -------------------------------------------------------------------
def _lost_before(run_dir: Path, stop_at: float) -> dict[str, int]:
    """Model calls (and their tokens) that had finished before the stop and were generated again after it:
    per (slot, turn), a call of the stopped run finished by ``stop_at`` whose turn the relaunch generated."""
    pre = work_lost._read_audit(run_dir / "audit-crash")
    post = work_lost._read_audit(run_dir / "audit-rerun")
    redone = {(*work_lost._slot(c["key"])[:2], c["turn"]) for c in post}
    calls = tokens = after_calls = 0
    for c in pre:
        if (*work_lost._slot(c["key"])[:2], c["turn"]) not in redone:
            continue
        if c["t"] <= stop_at:
            calls += 1
            tokens += int(c["tokens"])
        else:
            after_calls += 1
    return {"calls": calls, "tokens": tokens, "after_signal_calls": after_calls}


def _restored_kind(res: dict[str, Any], final_row: dict[str, Any] | None) -> str:
    snap = (res.get("restore_record") or {}).get("snapshot")
    if not snap:
        return "none"
    if final_row is not None and final_row.get("path") == snap:
        return "final"
    return "periodic"


def measure_work_lost(*, intervals: list[float], seeds: list[int], workdir: Path, delay_s: float, steps: int,
                      window: tuple[float, float], grace_s: float, timeout_s: float, log: Log) -> list[dict[str, Any]]:
    results = []
    for interval in intervals:
        for seed in seeds:
            d = random.Random(seed).uniform(*window)
            for behaviour in (BEFORE, FINAL):
                tag = "before" if behaviour == BEFORE else "final"
                run_dir = fresh_dir(Path(workdir).resolve() / f"lost-{interval:g}s-{tag}-s{seed}")
                started = time.monotonic()
                how = "sigkill" if behaviour == BEFORE else "sigterm"
                res = work_lost.run_experiment(SETUP, "turn", seed, d, run_dir, delay_s=delay_s, interval_s=interval,
                                               steps=steps, log=log, timeout_s=timeout_s,
                                               stop=stopper(how, grace_s), wait_for_snapshot=False)
                res.update(interval_s=interval, behaviour=behaviour, seconds=time.monotonic() - started)
                stop = res.get("stop") or {}
                if not res.get("error"):
                    final_row = stop.get("final_row")
                    res["lost_before_stop"] = _lost_before(run_dir, stop["signalled_at"])
                    res["restored_from"] = _restored_kind(res, final_row)
                    res["problems"] = _problems(res, stop, how)
                results.append(res)
                if res.get("error"):
                    log(f"{interval:g}s {behaviour} seed {seed}: {res['error']}")
                    continue
                lb = res["lost_before_stop"]
                log(f"{interval:g}s {behaviour} seed {seed}: stop {res['crash_after_step1_s']:.2f}s into step 2 "
                    f"(load {stop.get('loadavg_1m', float('nan')):.1f}); {res['in_flight']} in flight -> "
                    f"{res['restored']} restored ({res['restored_from']} snapshot), {res['restarted']} restarted; "
                    f"finished turns regenerated {lb['calls']} ({lb['tokens']} tokens), all regenerated "
                    f"{res['regen_calls']}"
                    + (f"; signal -> exit {stop['exit_s']:.1f}s, status {stop.get('returncode')}" if how == "sigterm"
                       else "") + (f"; PROBLEMS: {'; '.join(res['problems'])}" if res["problems"] else "")
                    + f" ({res['seconds']:.0f}s)")
    return results


def _problems(res: dict[str, Any], stop: dict[str, Any], how: str) -> list[str]:
    """What went wrong in one stop and relaunch that the numbers do not show."""
    out = []
    if how == "sigterm":
        if not stop.get("status_ok"):
            out.append(f"exit status {stop.get('returncode')} with {len(stop.get('stop_lines') or [])} 'stopped by' "
                       f"line(s) (expected {SIGTERM_STATUS} and one)")
        final_row = stop.get("final_row")
        if final_row is None or not final_row.get("committed"):
            out.append(f"no committed final snapshot: {final_row}")
        elif res.get("restored_from") != "final":
            out.append(f"the relaunch restored {res.get('restore_record', {}).get('snapshot')}, not the final snapshot")
        if stop.get("hung"):
            out.append("the driver did not exit within the grace + 60 s (killed)")
    if not res.get("lineage_ok"):
        out.append("the relaunch did not train every prompt group exactly once")
    if res.get("stragglers"):
        out.append(f"{len(res['stragglers'])} process(es) left running after a run (killed)")
    return out


def _lost_rows(results: list[dict[str, Any]], intervals: list[float]) -> list[dict[str, Any]]:
    rows = []
    for interval in intervals:
        for behaviour in (BEFORE, FINAL):
            mine = [r for r in results if r["interval_s"] == interval and r["behaviour"] == behaviour]
            ok = [r for r in mine if not r.get("error")]
            per_in_flight = [r["lost_before_stop"]["calls"] / r["in_flight"] for r in ok if r["in_flight"]]
            kinds: dict[str, int] = defaultdict(int)
            for r in ok:
                kinds[r["restored_from"]] += 1
            stops = [r.get("stop") or {} for r in ok]
            rows.append({
                "interval_s": interval, "behaviour": behaviour, "stops": len(ok),
                "errors": [r["error"] for r in mine if r.get("error")],
                "problems": [p for r in ok for p in r.get("problems") or []],
                "stop_after_step1_s": summary(r["crash_after_step1_s"] for r in ok),
                "in_flight": summary(r["in_flight"] for r in ok),
                "restored": summary(r["restored"] for r in ok),
                "restarted": summary(r["restarted"] for r in ok),
                "kept": summary(r["kept"] for r in ok),
                "restored_from": dict(kinds),
                "restored_snapshot_age_s": summary(r["crash_after_snapshot_s"] for r in ok
                                                   if r.get("restored_from") == "periodic"
                                                   and r.get("crash_after_snapshot_s") is not None),
                "lost_calls": summary(r["lost_before_stop"]["calls"] for r in ok),
                "lost_tokens": summary(r["lost_before_stop"]["tokens"] for r in ok),
                "lost_calls_per_in_flight": summary(per_in_flight),
                "lost_tokens_per_in_flight": summary(r["lost_before_stop"]["tokens"] / r["in_flight"]
                                                     for r in ok if r["in_flight"]),
                "regen_calls": summary(r["regen_calls"] for r in ok),
                "regen_tokens": summary(r["regen_tokens"] for r in ok),
                "exit_s": summary(s["exit_s"] for s in stops if s.get("how") == "sigterm" and "exit_s" in s),
                "statuses": sorted({s.get("returncode") for s in stops if s.get("returncode") is not None}),
                "loadavg_1m": summary(s["loadavg_1m"] for s in stops if "loadavg_1m" in s),
                "lineage_ok": all(r["lineage_ok"] for r in ok),
                "stragglers": sum(len(r.get("stragglers") or []) for r in mine),
            })
    return rows


# -- part 2: seconds from SIGTERM to exit at N in flight -------------------------------------------------
class _AuditCount:
    """Rollouts with at least one finished model call so far, from the audit files a run is writing."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.offsets: dict[Path, int] = {}
        self.keys: set[str] = set()

    def poll(self) -> int:
        for path in sorted(self.directory.glob("*.jsonl")):
            at = self.offsets.get(path, 0)
            with open(path, "rb") as f:
                f.seek(at)
                data = f.read()
            end = data.rfind(b"\n") + 1
            for line in data[:end].splitlines():
                # the key is the first field (sort_keys): no JSON parse per line at N = 8192
                if b'"status": 200' in line:
                    start = line.find(b'"key": "') + 8
                    self.keys.add(line[start:line.find(b'"', start)].decode())
            self.offsets[path] = at + end
        return len(self.keys)


def _shape(n: int, generations: int) -> tuple[int, int]:
    gens = min(generations, n)
    return max(1, n // gens), gens


def _exit_delay(delays: float | dict[int, float], n: int) -> float:
    if not isinstance(delays, dict):
        return float(delays)
    return float(delays.get(n, max(delays.values())))


def exit_once(root: Path, n: int, *, generations: int, delay_s: float, fill: float, grace_s: float | None,
              timeout_s: float, extra: list[str], log: Log) -> dict[str, Any]:
    prompts, gens = _shape(n, generations)
    dirs = RunDirs(fresh_dir(root))
    audit = root / "audit"
    args = ["--config", CONFIG, SCRIPTED, f"logger.log_dir={dirs.logs}", f"checkpointing.checkpoint_dir={dirs.ckpt}",
            "logger.progress_bar=false", "logger.plot=false", *scripted_overrides(delay_s),
            "grpo.max_num_steps=2", f"grpo.num_prompts_per_step={prompts}", f"grpo.num_generations_per_prompt={gens}",
            "rollout_checkpointing.snapshot_attempt_interval_s=null",
            *([f"rollout_checkpointing.stop_grace_s={grace_s}"] if grace_s is not None else []), *extra]
    env = run_env(marker=new_marker(), pythonpath=[INSTRUMENT], extra={"BENCH_AUDIT_DIR": str(audit)})
    count = _AuditCount(audit)
    need = math.ceil(fill * n)
    every_s = max(0.25, n / 8192)  # reading the audit is work on the cores the run uses
    state = {"at": -1e9, "had": 0, "ready_at": None}

    def ready(elapsed: float) -> bool:
        if elapsed - state["at"] >= every_s:
            state["at"] = elapsed
            state["had"] = count.poll()
        return state["had"] >= need

    command = " ".join(["python", "examples/run_grpo.py", *args])
    log(f"N={n} ({prompts}x{gens}, one replica, {delay_s:g}s per reply, snapshots off): SIGTERM once {need} "
        "rollouts have a finished model call")
    t = time.monotonic()
    outcome, info = run_and_stop(args, env, root / "run.out", ready, timeout_s, how="sigterm",
                                 grace_s=grace_s if grace_s is not None else GRACE_S, logs=dirs.logs)
    res: dict[str, Any] = {"n": n, "prompts": prompts, "generations": gens, "delay_s": delay_s, "command": command,
                           "with_finished_call_at_signal": state["had"], "seconds": time.monotonic() - t, **info}
    if outcome.killed_by != "SIGTERM":
        if outcome.killed_by == "timeout":
            res["error"] = (f"never reached {need} rollouts with a finished call ({state['had']} at the "
                            f"{timeout_s:g} s timeout)")
        else:
            res["error"] = (f"the run ended (rc {outcome.returncode}) before the signal "
                            f"({_last_line(root / 'run.out')}); see {root / 'run.out'}")
        log(f"  N={n}: {res['error']}")
        return res
    final = info.get("final_row") or {}
    res["in_flight_at_snapshot"] = sum(int(final.get(k) or 0) for k in ("saved", "unsaved", "not_admitted"))
    problems = []
    if not info.get("status_ok"):
        problems.append(f"exit status {info.get('returncode')} with {len(info.get('stop_lines') or [])} "
                        f"'stopped by' line(s) (expected {SIGTERM_STATUS} and one)")
    if not final.get("committed"):
        problems.append(f"final snapshot not committed: {final.get('reason') or final or 'no row'}")
    if info.get("leftover"):
        problems.append(f"{len(info['leftover'])} process(es) of the run still alive 30 s after its exit")
    if info.get("hung"):
        problems.append("the driver did not exit within the grace + 60 s (killed)")
    res["problems"] = problems
    log(f"  N={n}: signal -> final row {_s(info.get('final_row_s'))}, -> exit {_s(info.get('exit_s'))} "
        f"(status {info.get('returncode')}); {info.get('final_attempts')} attempt(s); row: committed {final.get('committed')}, saved {final.get('saved')}, "
        f"unsaved {final.get('unsaved')}, not admitted {final.get('not_admitted')}, pause {_s(final.get('pause_s'))}, "
        f"persist {_s(final.get('persist_s'))}; {info['alive_at_exit']} processes alive at exit, none after "
        f"{info['gone_after_exit_s']:.1f}s; load {info.get('loadavg_1m', float('nan')):.1f}"
        + (f"; PROBLEMS: {'; '.join(problems)}" if problems else ""))
    return res


def _last_line(path: Path) -> str:
    """The run's last unindented output line (a traceback's message), for an error row."""
    lines = [line for line in Path(path).read_text(errors="replace").splitlines() if line and not line[0].isspace()]
    return lines[-1][:200] if lines else "no output"


def _s(v: Any) -> str:
    return "—" if v is None else f"{float(v):.2f}s"


def measure_exit(*, sizes: list[int], repeats: int, workdir: Path, generations: int,
                 delays: float | dict[int, float], fill: float, grace_s: float | None,
                 timeout_s: float | dict[int, float], extra: list[str], log: Log) -> list[dict[str, Any]]:
    out = []
    for n in sizes:
        for i in range(repeats):
            limit = timeout_s if not isinstance(timeout_s, dict) else timeout_s.get(n, max(timeout_s.values()))
            out.append(exit_once(Path(workdir).resolve() / f"exit-{n}-r{i}", n, generations=generations,
                                 delay_s=_exit_delay(delays, n), fill=fill, grace_s=grace_s, timeout_s=float(limit),
                                 extra=extra, log=log))
    return out


def _exit_rows(runs: list[dict[str, Any]], sizes: list[int]) -> list[dict[str, Any]]:
    rows = []
    for n in sizes:
        mine = [r for r in runs if r["n"] == n]
        ok = [r for r in mine if not r.get("error")]
        finals = [r.get("final_row") or {} for r in ok]
        rows.append({
            "n": n, "runs": len(ok), "errors": [r["error"] for r in mine if r.get("error")],
            "problems": [p for r in ok for p in r.get("problems") or []],
            "in_flight_at_snapshot": summary(r["in_flight_at_snapshot"] for r in ok),
            "saved": summary(int(f.get("saved") or 0) for f in finals),
            "unsaved": summary(int(f.get("unsaved") or 0) for f in finals),
            "not_admitted": summary(int(f.get("not_admitted") or 0) for f in finals),
            "committed": sum(1 for f in finals if f.get("committed")),
            "attempts": summary(int(r.get("final_attempts") or 0) for r in ok),
            "final_row_s": summary(r["final_row_s"] for r in ok if r.get("final_row_s") is not None),
            "exit_s": summary(r["exit_s"] for r in ok if r.get("exit_s") is not None),
            "pause_s": summary(float(f["pause_s"]) for f in finals if f.get("pause_s") is not None),
            "persist_s": summary(float(f["persist_s"]) for f in finals if f.get("persist_s") is not None),
            "statuses": sorted({r.get("returncode") for r in ok if r.get("returncode") is not None}),
            "alive_at_exit": summary(r["alive_at_exit"] for r in ok),
            "gone_after_exit_s": summary(r["gone_after_exit_s"] for r in ok),
            "leftover": sum(len(r.get("leftover") or []) for r in mine),
            "loadavg_1m": summary(r["loadavg_1m"] for r in ok if "loadavg_1m" in r),
            "delay_s": mine[0]["delay_s"] if mine else None,
        })
    return rows


# -- the measurement -----------------------------------------------------------------------------------
def measure(*, workdir: Path, log: Log | None = None, intervals: list[float] | tuple[float, ...] = (
                MAIN_JOB_INTERVAL_S, 120.0), seeds: list[int] | tuple[int, ...] = (0, 1, 2), delay_s: float = 2.0,
            steps: int = 3, window: tuple[float, float] = (1.0, 5.0), timeout_s: float = 300.0,
            sizes: list[int] | tuple[int, ...] = (512, 8192), exit_repeats: int = 1, generations: int = 16,
            exit_delay_s: float | dict[int, float] | None = None, fill: float = 0.98, grace_s: float | None = None,
            exit_timeout_s: float | dict[int, float] | None = None, exit_extra: list[str] | tuple[str, ...] = ()
            ) -> dict[str, Any]:
    """Part 1 over ``intervals`` x ``seeds`` x both behaviours; part 2 over ``sizes`` x ``exit_repeats``.
    ``grace_s`` None: the product's default ``stop_grace_s`` (part 2 only sets it when given)."""
    log = log or make_log(NAME)
    intervals, seeds, sizes = list(intervals), list(seeds), list(sizes)
    # a reply delay long enough that no rollout ends before the last one is admitted and has a finished call
    # (three calls each): at N = 8192 on 2 cores Gym receives the step's /run calls over 35-70 s
    exit_delay_s = exit_delay_s if exit_delay_s is not None else {512: 10.0, 2048: 25.0, 8192: 60.0}
    exit_timeout_s = exit_timeout_s if exit_timeout_s is not None else {512: 240.0, 8192: 480.0}
    lost = measure_work_lost(intervals=intervals, seeds=seeds, workdir=workdir, delay_s=delay_s, steps=steps,
                             window=window, grace_s=grace_s or GRACE_S, timeout_s=timeout_s, log=log) \
        if intervals and seeds else []
    exits = measure_exit(sizes=sizes, repeats=exit_repeats, workdir=workdir, generations=generations,
                         delays=exit_delay_s, fill=fill, grace_s=grace_s, timeout_s=exit_timeout_s,
                         extra=list(exit_extra), log=log) if sizes and exit_repeats else []
    rows = _lost_rows(lost, intervals)
    exit_rows = _exit_rows(exits, sizes)
    return {"name": NAME, "title": TITLE, "rows": rows, "exit_rows": exit_rows, "goal": goal_of(rows, exit_rows),
            "experiments": lost, "exits": exits,
            "config": {"config": CONFIG, "intervals_s": intervals, "seeds": seeds, "backend_delay_s": delay_s,
                       "max_num_steps": steps, "stop_window_after_step1_s": list(window),
                       "behaviours": BEHAVIOURS, "sizes": sizes, "exit_repeats": exit_repeats,
                       "generations": generations,
                       "exit_backend_delay_s": {str(k): v for k, v in exit_delay_s.items()}
                       if isinstance(exit_delay_s, dict) else exit_delay_s,
                       "fill": fill, "stop_grace_s": grace_s if grace_s is not None else f"default ({GRACE_S:g})",
                       "exit_extra": list(exit_extra),
                       "backend": "scripted (plays each row's demonstration: 3 model calls), recording trainer"}}


def goal_of(rows: list[dict[str, Any]], exit_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """With the final snapshot no turn finished before the SIGTERM is regenerated, and every stop exits 143
    within the grace with a committed final snapshot and nothing left running."""
    finals = [r for r in rows if r["behaviour"] == FINAL and r["stops"]]
    worst = max((r["lost_calls"]["max"] for r in finals), default=None)
    exits = [r for r in exit_rows if r["runs"]]
    slowest = max((r["exit_s"]["max"] for r in exits if r["exit_s"]["n"]), default=None)
    # a run that failed before its stop (e.g. Ray could not start on a loaded machine) counts against it too
    clean = (all(not r["problems"] and not r["errors"] and r["committed"] == r["runs"] and r["leftover"] == 0
                 for r in exit_rows)
             and all(not r["problems"] and not r["errors"] for r in rows if r["behaviour"] == FINAL)) \
        if (exits or finals) else None
    return {"final_regenerates_no_finished_turn": None if worst is None else worst == 0,
            "max_finished_turns_regenerated_with_final": None if worst is None else int(worst),
            "before": {f"{r['interval_s']:g}": r["lost_calls"]["median"] for r in rows
                       if r["behaviour"] == BEFORE and r["stops"]},
            "final": {f"{r['interval_s']:g}": r["lost_calls"]["median"] for r in finals},
            "slowest_exit_s": slowest, "grace_s": GRACE_S,
            "exit_within_grace": None if slowest is None else slowest <= GRACE_S,
            "every_stop_clean": clean}


def verdict(g: dict[str, Any]) -> str:
    def yes(v: Any) -> str:
        return "not measured" if v is None else ("met" if v else "NOT met")

    slowest = "—" if g.get("slowest_exit_s") is None else f"{g['slowest_exit_s']:.1f} s"
    before = ", ".join(f"{k} s: {v:g}" for k, v in g.get("before", {}).items() if v is not None) or "—"
    worst = g.get("max_finished_turns_regenerated_with_final")
    return (f"with the final snapshot no turn finished before the SIGTERM is regenerated: "
            f"{yes(g.get('final_regenerates_no_finished_turn'))} (worst {worst}; "
            f"before, median per preemption: {before}); SIGTERM to exit within the {g.get('grace_s', GRACE_S):g} s "
            f"grace: {yes(g.get('exit_within_grace'))} (slowest {slowest}); exit 143, a committed final snapshot and "
            f"nothing left running every time: {yes(g.get('every_stop_clean'))}")


def table(res: dict[str, Any]) -> str:
    cfg = res["config"]
    head = ["snapshot interval", "behaviour", "stops", "rollouts in flight", "restored at turn",
            "restarted from prompt", "restored from", "age of the restored periodic snapshot s",
            "finished turns regenerated", "…per in-flight rollout", "their tokens", "tokens per in-flight rollout",
            "all calls regenerated (incl. after the signal)", "signal → exit s", "exit status", "load 1m"]
    body = []
    for r in res["rows"]:
        final = r["behaviour"] == FINAL
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(r["restored_from"].items())) or "—"
        body.append([f"{r['interval_s']:g} s", r["behaviour"], r["stops"] if not r["errors"] else
                     f"{r['stops']} ({len(r['errors'])} failed)", fmt(r["in_flight"]), fmt(r["restored"]),
                     fmt(r["restarted"]), kinds, fmt(r["restored_snapshot_age_s"], 1, 2),
                     fmt(r["lost_calls"]), fmt(r["lost_calls_per_in_flight"], 1, 2), fmt(r["lost_tokens"]),
                     fmt(r["lost_tokens_per_in_flight"], 1, 1), fmt(r["regen_calls"]),
                     fmt(r["exit_s"], 1, 1) if final else "— (SIGKILL)",
                     ", ".join(str(s) for s in r["statuses"]) or "—", fmt(r["loadavg_1m"], 1, 1)])
    part1 = md_table(head, body)
    head2 = ["N in flight", "runs", "reply delay s", "in the final snapshot (saved / unsaved / not admitted)",
             "committed", "final snapshot attempts", "signal → committed row s", "signal → exit s", "pause ms", "persist ms", "exit status",
             "processes alive at exit", "all gone after s", "left after 30 s", "load 1m"]
    body2 = [[f"{r['n']:,}", r["runs"] if not r["errors"] else f"{r['runs']} ({len(r['errors'])} failed)",
              f"{r['delay_s']:g}" if r["delay_s"] is not None else "—",
              f"{fmt(r['saved'])} / {fmt(r['unsaved'])} / {fmt(r['not_admitted'])}", f"{r['committed']}/{r['runs']}",
              fmt(r.get("attempts")), fmt(r["final_row_s"], 1, 2), fmt(r["exit_s"], 1, 2), fmt(r["pause_s"], 1e3), fmt(r["persist_s"], 1e3),
              ", ".join(str(s) for s in r["statuses"]) or "—", fmt(r["alive_at_exit"]),
              fmt(r["gone_after_exit_s"], 1, 1), r["leftover"], fmt(r["loadavg_1m"], 1, 1)] for r in res["exit_rows"]]
    part2 = md_table(head2, body2)
    problems = [f"- {r['interval_s']:g} s {r['behaviour']}: {p}"
                for r in res["rows"] for p in r["problems"] + r["errors"]]
    problems += [f"- N={r['n']}: {p}" for r in res["exit_rows"] for p in r["problems"] + r["errors"]]
    seeds = ", ".join(str(s) for s in cfg["seeds"])
    parts = []
    if body:
        parts.append(f"Work lost per preemption: {cfg['config']}, turn level, {cfg['backend_delay_s']:g} s per reply, "
                     f"stop {cfg['stop_window_after_step1_s'][0]:g}–{cfg['stop_window_after_step1_s'][1]:g} s after "
                     f"step 1's metrics line (seeds {seeds}), then the same command to completion. *Finished turns "
                     "regenerated*: model calls finished before the stop and generated again by the relaunch; "
                     f"*all*: also calls that finished while the run was stopping. Medians (min–max).\n\n{part1}")
    if body2:
        parts.append("Seconds from SIGTERM to exit, one Gym replica, all rollouts of step 1 in flight (each with a "
                     f"finished call), periodic snapshots off, stop_grace_s {cfg['stop_grace_s']}:\n\n{part2}")
    if problems:
        parts.append("Problems:\n" + "\n".join(problems))
    return "\n\n".join(parts) or "Nothing measured."
