"""Measure turn-level rollout recovery on this machine.

    python examples/bench_recovery.py            # full run (about 30 minutes on 2 cores)
    python examples/bench_recovery.py --quick    # small N, few repeats (a few minutes)
    python examples/bench_recovery.py --preset n8192   # N = 2048 and 8192 on one replica, both commit modes,
                                                       # plus the bookkeeping rows (about 15 minutes, under 25)
    python examples/bench_recovery.py --only snapshot_cost --sizes 2048,8192 --per-replica 8192 --repeats 3
    python examples/bench_recovery.py --preset async --out bench_results/async   # 9. async against sync, the
                                                                                 # main job itself (about 30 min)
    python examples/bench_recovery.py --only snapshot_cost,stall --out /tmp/bench
    python examples/bench_recovery.py --preset preemption --out bench_results/preemption   # 11. work lost per
                                         # preemption, SIGTERM to exit at N = 512 and 8192 (about 30 min)
    python examples/bench_recovery.py --only snapshot_cost,overhead --variant staged rollout_checkpointing.commit_mode=staged --variant blocking rollout_checkpointing.commit_mode=blocking
    python examples/bench_recovery.py --preset restore_io --out bench_results/restore_io   # 15. a relaunch with a
                                         # ~1 GB model: reads, weights shipped, time by phase (3 repeats)
    python examples/bench_recovery.py --preset replay_recovery --out bench_results/replay   # 19. replay against a
                                         # restart from the prompt on the mixed setup (about 15 minutes)
    python examples/bench_recovery.py --preset restore_io --product /path/to/other/checkout   # the same
                                         # measurement of another commit of the product (this one counts)

Every snapshot measured as the product's is taken by the controller itself in
a real GRPO run (scripted backend, recording trainer), started and reaped
through the run harness (``testkit/run_harness.py``: ``python -m testkit.run_grpo``,
the product's main). ``--variant LABEL
OVERRIDE...`` (repeatable) runs measurements 1, 2 and 5 once per variant with
those config overrides laid over each run, and prints them side by side.

Measurements (see docs/benchmarks.md for the method behind each):
  snapshot_cost  1. snapshot pause, prepare/commit/publish time and bytes versus rollouts in flight
  stall          2. K snapshot attempts with a restart-only agent: block versus best_effort
  work_lost      3. model calls and tokens regenerated after a SIGKILL, per recovery level and setup
  alternative    4. the rejected "resume, retire blockers, prepare again" versus best effort
  overhead       5. rollouts per minute with snapshots every T seconds versus none
  setup_check    6. seconds from launch to the setup error of the mixed config as shipped
  relaunch       7. seconds from the relaunch after a SIGKILL to the first dispatched rollout, by phase
  bookkeeping    8. bytes read and seconds of trainer-checkpoint bookkeeping per save and restore lookup
  async_throughput 9. async (lookahead 1) against sync on the main job: steps/hour, snapshot overhead,
                 coverage, learning (preset ``async``: real model and trainer, not the scripted backend)
  prefix_work_lost 10. regenerated tokens per restored call at prefix against turn, and the cut's pause
                 at N=512 (preset ``prefix``: the torch worker with long generations)
  preemption     11. finished turns regenerated per preemption, final snapshot (SIGTERM) against a SIGKILL
                 (restore from the newest periodic snapshot), and seconds from SIGTERM to exit at N in
                 flight (preset ``preemption``; ``preemption_smoke`` checks it works in 2-3 minutes)
  gym_recovery   14. in-run recovery of a Gym server and of a replica: loss to the first continued rollout,
                 turns regenerated against a restart from the prompt, the other replica's throughput
                 (preset ``gym_recovery``, about 5 minutes; ``gym_recovery_smoke``)
  restore_io     15. a relaunch with a model of about 1 GB: reads of the trainer step's files, weights
                 shipped to generation, time to the first dispatch by phase (preset ``restore_io``;
                 ``restore_io_smoke`` with a small model; ``--product`` measures another checkout)
  generation_recovery 16. in-run recovery of the generation worker at turn and prefix: loss to the first
                 call sent again, tokens kept from cuts (preset ``generation_recovery``, about 5 minutes;
                 ``generation_recovery_smoke``)
  deterministic_cost 17. grpo.deterministic on against off on the main job: steps per hour, load average
                 (preset ``deterministic_cost``, about 20 minutes; ``deterministic_cost_smoke``)
  recovery_scale 18. in-run recovery of a replica at N = 4096 and 8192 in flight on two replicas: loss to the
                 first continued rollout, the restored snapshot's age, finished turns lost per affected rollout
                 (preset ``recovery_scale``, about 20 minutes; ``recovery_scale_smoke``)
  replay_recovery 19. rollouts on restart-only servers back by replay against a restart from the prompt (mixed
                 setup, one replica): finished turns generated again and restore to the first live call per restored
                 rollout; the snapshot's pause and bytes per turn at N = 512 with replay records and without; the
                 records' capture cost per interval (preset ``replay_recovery``, about 15 minutes;
                 ``replay_recovery_smoke``)

A preset without parameters for a measurement skips it (``n8192``: measurements 1 and 8 only).
Measurement 1 reports steady and burst attempts apart (``bench/snapshot_cost.py``); its goals are
evaluated on steady attempts.

Prints progress lines and one markdown table per measurement, writes
``<out>/recovery.json``, ``<out>/recovery.md`` and ``<out>/<measurement>.png``.
Every server and run it starts is stopped before it exits.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from bench import (  # noqa: E402
    alternative,
    async_throughput,
    bookkeeping,
    deterministic_cost,
    generation_recovery,
    gym_recovery,
    overhead,
    preemption,
    prefix_work_lost,
    recovery_scale,
    relaunch,
    replay_recovery,
    restore_io,
    setup_check,
    snapshot_cost,
    stall,
    work_lost,
)
from bench.common import SharedGym, fmt, machine_info, make_log  # noqa: E402
from bench.plots import PLOTTERS, plot  # noqa: E402
from bench.presets import PRESETS  # noqa: E402

MODULES = {m.NAME: m for m in (snapshot_cost, stall, work_lost, alternative, overhead, setup_check, relaunch,
                               bookkeeping, async_throughput, prefix_work_lost, preemption, restore_io,
                               gym_recovery, generation_recovery, recovery_scale, deterministic_cost,
                               replay_recovery)}
ORDER = list(MODULES)
SHARED = {"alternative"}  # its baseline loop drives a Gym deployment of its own
VARIANT_AWARE = {"snapshot_cost", "stall", "overhead"}  # accept ``variants``


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small N and few repeats (under 3 minutes)")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="full (default), quick, tiny or n8192 (measurements 1 and 8 at N = 2048 and 8192)")
    p.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(ORDER)}")
    p.add_argument("--out", default="bench_results", help="where recovery.json, recovery.md and the PNGs go")
    p.add_argument("--workdir", default=None, help="scratch space (default: a temp dir, removed at the end)")
    p.add_argument("--keep-workdir", action="store_true", help="keep run logs and checkpoints")
    p.add_argument("--sizes", default=None, help="override snapshot_cost sizes, e.g. 8,64,512")
    p.add_argument("--per-replica", type=int, default=None, metavar="N",
                   help="snapshot_cost: rollouts per Gym replica (default 2048; N above it uses ceil(N / this) "
                        "replicas), e.g. 8192 to run N = 8192 on one replica like N = 2048")
    p.add_argument("--repeats", type=int, default=None,
                   help="override snapshot_cost repeats (steady snapshots each run waits for)")
    p.add_argument("--variant", nargs="+", action="append", default=None, metavar=("LABEL", "OVERRIDE"),
                   help="a label and config overrides for every controller run of measurements 1, 2 and 5; "
                        "repeat to compare variants side by side")
    p.add_argument("--product", default=None, metavar="DIR",
                   help="restore_io: run another checkout of the product (its run_grpo, configs and code; this "
                        "checkout's benchmark counts), e.g. a git worktree of the commit before a change")
    p.add_argument("--render", default=None, metavar="JSON",
                   help="measure nothing: re-derive the verdicts and redraw tables and plots from a recovery.json")
    return p.parse_args(argv)


def git_state(checkout: Path = HERE.parent) -> dict[str, Any]:
    """The commit measured, and which tracked files differed from it (read-only git calls)."""
    import subprocess

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=checkout, capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    changed = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines() if line]
    return {"head": git("rev-parse", "--short", "HEAD").strip() or None, "modified_tracked_files": changed}


def fsync_latency_ms(directory: Path, samples: int = 20) -> float:
    """Median time to write and fsync 4 KiB in ``directory`` (context for the tables)."""
    times = []
    for i in range(samples):
        path = directory / f".fsync-probe-{i}"
        t = time.perf_counter()
        with open(path, "wb") as f:
            f.write(b"x" * 4096)
            f.flush()
            os.fsync(f.fileno())
        times.append(time.perf_counter() - t)
        path.unlink()
    return sorted(times)[len(times) // 2] * 1e3


def goal_lines(results: dict[str, Any]) -> list[str]:
    def yes(v: Any) -> str:
        return "not measured" if v is None else ("met" if v else "NOT met")

    lines = []
    if "snapshot_cost" in results:
        g = results["snapshot_cost"]["goal"]
        for variant, gv in g.get("by_variant", {}).items():
            tag = f" [{variant}]" if len(g["by_variant"]) > 1 else ""
            disk, shm = gv.get("disk", {}), gv.get("tmpfs", {})
            detail = ""
            if disk.get("excess_ms_median") is not None:
                detail = (f" (disk: median {disk['excess_ms_median']:.0f} ms over the tool, worst "
                          f"{disk['excess_ms_max']:.0f} ms")
                if shm.get("excess_ms_median") is not None:
                    detail += (f"; tmpfs: median {shm['excess_ms_median']:.0f} ms, worst "
                               f"{shm['excess_ms_max']:.0f} ms, {yes(shm.get('met'))}")
                detail += ")"
            lines.append(f"1.{tag} pause at N={g['at_n']} within {g['pause_within_ms_of_longest_tool']:g} ms of the "
                         f"longest tool call in flight: {yes(disk.get('met'))}{detail}")
            slope = gv.get("pause_loglog_slope")
            gr = gv.get("growth") or {}
            shown = ("" if gr.get("ratio") is None else
                     f"x{gr['ratio']:.2f}: {gr['pause_ms_from']:,.0f} → {gr['pause_ms_to']:,.0f} ms; ")
            lines.append(f"1.{tag} idle pause growth from N={g.get('growth_from_n', 512)} to "
                         f"N={g.get('growth_to_n', 2048)} at most x{g.get('growth_max', 4.5):g}: "
                         f"{yes(gr.get('met'))} ({shown}log-log slope of the pause over all N: "
                         f"{'—' if slope is None else f'{slope:.2f}'}"
                         + ("; a step grew faster than N" if gv.get("every_step_within_linear") is False else "")
                         + ")")
            lg = g.get("large")
            if lg:
                big = (gv.get("large") or {}).get("disk") or {}
                detail = ("" if big.get("excess_ms_median") is None else
                          f" (disk: median {big['excess_ms_median']:.0f} ms over the tool, worst "
                          f"{big['excess_ms_max']:.0f} ms, {big.get('attempts', '?')} attempt(s))")
                lines.append(f"1.{tag} pause at N={lg['at_n']} within {lg['pause_within_ms_of_longest_tool']:g} ms "
                             f"of the longest tool call in flight: {yes(big.get('met'))}{detail}")
                gr = (gv.get("large") or {}).get("growth") or {}
                shown = ("" if gr.get("ratio") is None else
                         f" (x{gr['ratio']:.2f}: {gr['pause_ms_from']:,.0f} → {gr['pause_ms_to']:,.0f} ms)")
                lines.append(f"1.{tag} idle pause growth from N={lg['growth_from_n']} to N={lg['growth_to_n']} at most "
                             f"x{lg['growth_max']:g}: {yes(gr.get('met'))}{shown}")
        if g.get("basis"):
            lines.append(f"1. every goal of measurement 1 is evaluated on {g['basis']}")
        sb = g.get("staged_over_blocking")
        if sb is not None:
            detail = (f"{sb['ratio']:.2f} = {sb['staged_pause_ms']:,.0f} / {sb['blocking_pause_ms']:,.0f} ms"
                      if sb.get("ratio") is not None else sb.get("note", ""))
            lines.append(f"1. staged / blocking idle pause at N={sb['at_n']} (disk) at most {sb['max_ratio']:g}: "
                         f"{yes(sb.get('met'))} ({detail})")
    if "stall" in results:
        g = results["stall"]["goal"]
        lines.append(f"2. block commits 0 snapshots: {yes(g['block_commits_none'])}; "
                     f"best effort commits all: {yes(g['best_effort_commits_all'])}")
    if "work_lost" in results:
        g = results["work_lost"]["goal"]
        lines.append(f"3. a saved rollout regenerates at most the one model call in flight: {yes(g['met'])} "
                     f"(worst: {g['max_regenerated_before_snapshot_end']} over {g['restored_rollouts']} restored "
                     f"rollouts; including work done after the snapshot: {g['max_regenerated_including_after_snapshot']})")
    if "alternative" in results:
        c = results["alternative"]["comparison"]
        ratio = c["best_effort_over_alternative"]
        shown = "∞" if ratio == float("inf") else (f"{ratio:.1f}x" if ratio else "n/a")
        kept_b, kept_a = c.get("best_effort_vs_none"), c.get("alternative_vs_none")
        lines.append(f"4. share of the no-snapshot throughput kept: best effort (controller) "
                     f"{'—' if kept_b is None else f'{kept_b * 100:.0f}%'}, rejected alternative (baseline loop) "
                     f"{'—' if kept_a is None else f'{kept_a * 100:.0f}%'}; ratio {shown}")
    if "overhead" in results:
        g = results["overhead"]["goal"]
        extra = ""
        if g.get("tmpfs_overhead_pct_median") is not None:
            extra = f"; snapshots on tmpfs: {g['tmpfs_overhead_pct_median']:.1f}%, {yes(g.get('tmpfs_met'))}"
        if g.get("reference_spread_pct") is not None:
            extra += f"; the no-snapshot reference itself varies by {g['reference_spread_pct']:.1f}% between repeats"
        for key, pct in (g.get("fixed_interval_overhead_pct_median") or {}).items():
            variant, interval = key.rsplit("/", 1)
            extra += (f"; every {interval}{f' ({variant})' if variant else ''}: "
                      + ("—" if pct is None else f"{pct:.1f}%"))
        med = g.get("overhead_pct_median")
        shown_med = "—" if med is None else f"{med:.1f}%"
        lines.append(f"5. overhead at most {g['max_overhead_pct_at_10_turns']:g}% at T = 10 turns: {yes(g.get('met'))} "
                     f"(median {shown_med}{extra})")
    if "setup_check" in results:
        rows = {r["part"]: r["seconds"]["median"] for r in results["setup_check"]["rows"]}
        lines.append(f"6. mixed config as shipped fails after {rows['to_error_s']:.1f}s (process exits after "
                     f"{rows['total_s']:.1f}s); Ray start {rows['ray_init_s']:.1f}s, Gym start "
                     f"{rows['gym_start_s']:.1f}s; error names every restart-only server: "
                     f"{yes(results['setup_check']['goal']['error_names_every_restart_only_server'])}")
    if "relaunch" in results:
        g = results["relaunch"]["goal"]
        rows = {r["kind"]: r for r in results["relaunch"]["rows"]}
        total = rows.get("relaunch", {}).get("to_first_dispatch_s") or {}
        lines.append(f"7. relaunch after a SIGKILL to the first dispatched rollout at most "
                     f"{g['relaunch_to_first_dispatch_max_s']:g} s: {yes(g.get('met'))} ({fmt(total, 1, 1)} s, "
                     f"median{' (min–max)' if (total.get('n') or 0) > 1 else ''} of {total.get('n') or 0} "
                     f"relaunch(es); first launch "
                     f"{fmt(rows.get('first', {}).get('to_first_dispatch_s'), 1, 1)} s; every relaunch resumed: "
                     f"{yes(g.get('every_relaunch_resumed'))}; 1-minute load average at relaunch "
                     f"{fmt(g.get('loadavg_1m_at_relaunch'), 1, 2)})")
    if "bookkeeping" in results:
        g = results["bookkeeping"]["goal"]
        keep = results["bookkeeping"]["config"]["keep"]

        def passes(key: str) -> str:
            return "" if g.get(key) is None else f" (most {g[key]:.2f} passes)"

        lines.append(f"8. trainer-checkpoint bookkeeping, keep_top_k={keep}: a save reads its own bytes at most once: "
                     f"{yes(g['save_reads_own_bytes_at_most_once'])}{passes('max_save_passes')}; its prune rereads no "
                     f"kept step: {yes(g['prune_rereads_no_kept_step'])}{passes('max_prune_passes')}; a restore-point "
                     f"lookup hashes only the step it restores: {yes(g['restore_hashes_only_the_restored_step'])}"
                     f"{passes('max_restore_passes')}")
    if "async_throughput" in results:
        lines.append("9. " + async_throughput.verdict(results["async_throughput"]["goal"]))
    if "prefix_work_lost" in results:
        lines.append("10. " + prefix_work_lost.verdict(results["prefix_work_lost"]["goal"]))
    if "preemption" in results:
        lines.append("11. " + preemption.verdict(results["preemption"]["goal"]))
    if "gym_recovery" in results:
        lines.append("14. " + gym_recovery.verdict(results["gym_recovery"]["goal"]))
    if "restore_io" in results:
        lines.append("15. " + restore_io.verdict(results["restore_io"]["goal"]))
    if "generation_recovery" in results:
        lines.append("16. " + generation_recovery.verdict(results["generation_recovery"]["goal"]))
    if "deterministic_cost" in results:
        lines.append("17. " + deterministic_cost.verdict(results["deterministic_cost"]["goal"]))
    if "recovery_scale" in results:
        lines.append("18. " + recovery_scale.verdict(results["recovery_scale"]["goal"]))
    if "replay_recovery" in results:
        lines.append("19. " + replay_recovery.verdict(results["replay_recovery"]["goal"]))
    return lines


def describe_machine(m: dict[str, Any]) -> str:
    return (f"{m.get('cpus')} CPUs, {m.get('memory_gib')} GiB RAM, Python {m.get('python')}, {m.get('platform')}; "
            f"write+fsync of 4 KiB in the scratch dir: {m.get('fsync_4k_ms_workdir')} ms")


def render_markdown(results: dict[str, Any], meta: dict[str, Any]) -> str:
    out = [f"# Recovery benchmark ({meta['preset']})", "",
           f"Command: `{meta['command']}`  ", f"Machine: {describe_machine(meta['machine'])}  ",
           f"Code: commit {meta['git']['head']}"
           + (f" with local changes to {len(meta['git']['modified_tracked_files'])} tracked file(s)"
              if meta["git"]["modified_tracked_files"] else "") + "  ",
           *([f"Product measured: {meta['product']['path']} at commit {meta['product']['head']}  "]
             if meta.get("product") else []),
           f"Total time: {meta['seconds'] / 60:.1f} min", ""]
    for name in ORDER:
        if name in results:
            res = results[name]
            out += [f"## {res['title']}", "", MODULES[name].table(res), ""]
            if name in PLOTTERS:
                out += [f"![{name}]({name}.png)", ""]
    out += ["## Goals", ""] + [f"- {line}" for line in goal_lines(results)] + [""]
    return "\n".join(out)


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and obj in (float("inf"), float("-inf")):
        return str(obj)
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def render(path: Path, out: Path) -> int:
    """Tables, plots and verdicts again from the measurements stored in ``path``."""
    data = json.loads(path.read_text())
    results, meta = data["results"], data["meta"]
    if "snapshot_cost" in results:
        snapshot_cost.rederive(results["snapshot_cost"])
    if "relaunch" in results:
        r = results["relaunch"]
        r["rows"] = relaunch.rows_of(r["repeats"])
        r["goal"] = relaunch.goal_of(r["rows"], r["repeats"], r["goal"].get("relaunch_to_first_dispatch_max_s",
                                                                        relaunch.GOAL_S))
    if "bookkeeping" in results:
        results["bookkeeping"]["goal"] = bookkeeping.goal_of(results["bookkeeping"]["results"])
    if "preemption" in results:
        r = results["preemption"]
        r["goal"] = preemption.goal_of(r["rows"], r["exit_rows"])
    if "restore_io" in results:
        r = results["restore_io"]
        r["rows"], r["goal"] = restore_io.rows_of(r["repeats"]), restore_io.goal_of(r["repeats"])
    out.mkdir(parents=True, exist_ok=True)
    for name, res in results.items():
        if name in PLOTTERS:
            plot(name, res, out)
    (out / "recovery.json").write_text(json.dumps(_json_safe({"meta": meta, "results": results}), indent=1) + "\n")
    (out / "recovery.md").write_text(render_markdown(results, meta))
    print("Goals:\n" + "\n".join(f"  {line}" for line in goal_lines(results)), flush=True)
    return 0


def plan(args: argparse.Namespace) -> tuple[str, dict[str, dict[str, Any]], list[str]]:
    """The preset's name and parameters with the command line's overrides laid over them, and the
    measurements to run, in order (``--only``, else every one the preset has parameters for)."""
    preset_name = args.preset or ("quick" if args.quick else "full")
    preset = {k: dict(v) for k, v in PRESETS[preset_name].items()}
    wanted = {s.strip() for s in args.only.split(",") if s.strip()} if args.only else set()
    unknown = wanted - set(ORDER)
    if unknown:
        raise ValueError(f"unknown measurement(s) {sorted(unknown)}; choose from {ORDER}")
    missing = wanted - set(preset)
    if missing:
        raise ValueError(f"preset {preset_name!r} has no parameters for {sorted(missing)}; it has {sorted(preset)}")
    chosen = [n for n in ORDER if n in preset and (not wanted or n in wanted)]
    cost: dict[str, Any] = {}
    if args.sizes:
        try:
            cost["sizes"] = [int(x) for x in args.sizes.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--sizes={args.sizes!r} must be whole numbers separated by commas (e.g. 512,2048)") \
                from None
        if not cost["sizes"] or min(cost["sizes"]) < 1:
            raise ValueError(f"--sizes={args.sizes!r} must list sizes of at least 1")
    for flag, key, value in (("--per-replica", "per_replica", args.per_replica),
                             ("--repeats", "repeats", args.repeats)):
        if value is not None:
            if value < 1:
                raise ValueError(f"{flag}={value} must be at least 1")
            cost[key] = value
    if args.product:
        if "restore_io" not in chosen:
            raise ValueError("--product sets restore_io, which this run does not include")
        preset["restore_io"]["product"] = str(Path(args.product).resolve())
    if cost:
        if "snapshot_cost" not in preset:
            raise ValueError(f"--sizes, --per-replica and --repeats set snapshot_cost, which preset {preset_name!r} "
                             "does not run")
        preset["snapshot_cost"].update(cost)
    return preset_name, preset, chosen


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        return render(Path(args.render).resolve(), Path(args.out).resolve())
    try:
        preset_name, preset, chosen = plan(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(args.workdir).resolve() if args.workdir else Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    workdir.mkdir(parents=True, exist_ok=True)
    log = make_log("bench")
    started = time.monotonic()
    meta: dict[str, Any] = {
        "preset": preset_name,
        "command": " ".join(["python", "examples/bench_recovery.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine_info(), "parameters": preset, "workdir": str(workdir),
        "started_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "git": git_state(),
        "variants": [{"label": v[0], "overrides": list(v[1:])} for v in args.variant] if args.variant else
        [{"label": label, "overrides": list(o)} for label, o in preset.get("snapshot_cost", {}).get("variants", [])],
    }
    if args.product:
        meta["product"] = {"path": str(Path(args.product).resolve()), **git_state(Path(args.product).resolve())}
    meta["machine"]["fsync_4k_ms_workdir"] = round(fsync_latency_ms(workdir), 2)
    log(f"{preset_name} run of {', '.join(chosen)}; scratch in {workdir}; fsync of 4 KiB takes "
        f"{meta['machine']['fsync_4k_ms_workdir']:.1f} ms there")
    results: dict[str, Any] = {}
    shared: SharedGym | None = None
    try:
        for name in chosen:
            module = MODULES[name]
            params = dict(preset[name])
            if args.variant and name in VARIANT_AWARE:
                params["variants"] = [(v[0], list(v[1:])) for v in args.variant]
            if name in SHARED:
                if shared is None:
                    log("starting the shared Gym deployment (model, Workplace, simple_agent, plain_loop_agent)")
                    shared = SharedGym(workdir).__enter__()
                params["env"] = shared
            elif shared is not None:
                shared.__exit__(None, None, None)
                shared = None
            t0 = time.monotonic()
            load_before = os.getloadavg()
            log(f"--- {module.TITLE} (load average {load_before[0]:.2f})")
            res = module.measure(workdir=workdir, log=make_log(name), **params)
            res["seconds"] = time.monotonic() - t0
            res["loadavg_1m"] = {"before": load_before[0], "after": os.getloadavg()[0]}
            results[name] = res
            png = plot(name, res, out) if name in PLOTTERS else None
            print("\n" + module.TITLE + "\n\n" + module.table(res) + "\n", flush=True)
            log(f"{name} done in {res['seconds']:.0f}s" + (f"; plot {png}" if png else ""))
            _write(out, results, meta, started)
    finally:
        if shared is not None:
            shared.__exit__(None, None, None)
        if not args.keep_workdir and not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    _write(out, results, meta, started)
    print("Goals:\n" + "\n".join(f"  {line}" for line in goal_lines(results)), flush=True)
    log(f"all done in {(time.monotonic() - started) / 60:.1f} min: {out / 'recovery.json'}, {out / 'recovery.md'}")
    return 0


def _write(out: Path, results: dict[str, Any], meta: dict[str, Any], started: float) -> None:
    meta["seconds"] = time.monotonic() - started
    (out / "recovery.json").write_text(json.dumps(_json_safe({"meta": meta, "results": results}), indent=1) + "\n")
    (out / "recovery.md").write_text(render_markdown(results, meta))


if __name__ == "__main__":
    sys.exit(main())
