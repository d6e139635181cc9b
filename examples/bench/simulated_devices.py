"""Async (lookahead 1) against sync on simulated devices (issue 32): the controller's overlap, not the cores.

    python examples/bench/simulated_devices.py --preset simulated_devices --out bench_results/simulated_devices
    python examples/bench/simulated_devices.py --preset simulated_devices_smoke --out /tmp/sim   # about a minute
    python examples/bench/simulated_devices.py --render bench_results/simulated_devices/simulated_devices.json

On a machine where generation and training share the cores, async against sync
measures CPU contention as much as the overlap the controller achieves
(docs/benchmarks.md §9). Here both run on stand-ins with their own wall-clock
timelines that use no CPU:

- generation: the scripted backend (``policy.model_name=scripted-test-backend``)
  as a stand-in for a generation device that decodes ``tokens_per_s`` fake tokens
  per second, shared by the replies in flight (``policy.scripted_backend.tokens_per_s``;
  a reply of k tokens alone takes k / ``tokens_per_s``), sleeping. Its throughput
  is fixed, like an accelerator's: async cannot generate two steps at once for
  free, which the ideal below assumes (with a fixed rate per reply and no limit
  on replies in flight, lookahead 1 beat the ideal);
- training: ``SimulatedTrainer``, a trainer stand-in that records the batches
  and sleeps ``seconds_per_sample`` per sample (``policy.simulated_trainer``).

Every run is a real GRPO run of ``examples/configs/grpo_workplace_turn.yaml``
(Workplace + simple_agent on loopback, the controller, checkpoints every step)
through the run harness (``python -m testkit.run_grpo``), snapshots off unless
``interval_s`` is set. Modes, interleaved per repeat (the order reversed on odd
repeats): sync (``async_rl.sampler.max_lookahead_versions=0``) and async
(lookahead 1, streaming from half the step's groups), both with
``grpo.use_generation_logprobs=true`` so only the lookahead differs.

Unless ``seconds_per_sample`` is given, a calibration run (sync, the plain
recording trainer) measures a sync step's generation time g0 first, and the
stand-in gets ``train_share / (1 - train_share) x g0 / samples per step``, so
training is about ``train_share`` of a sync step.

Figures, from each run's ``metrics.jsonl`` over steps 2..N: steps per hour =
3600 x steps / sum of ``step_s``; g and t = mean ``generation_s`` and
``training_s`` of the same repeat's sync run; ideal speed-up of lookahead 1 =
(g + t) / max(g, t); measured speed-up = rate(async) / rate(sync) of the same
repeat; goal: measured / ideal at least 0.9, with training 30-50 % of a sync step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for _path in (HERE.parent, HERE.parents[1]):  # examples/ (for ``bench``) and the repository
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from bench.async_throughput import mode_overrides  # noqa: E402
from bench.common import Log, fmt, fresh_dir, machine_info, make_log, md_table, summary  # noqa: E402
from testkit.run_harness import RunDirs, new_marker, run_env, run_once  # noqa: E402

NAME = "simulated_devices"
TITLE = ("12. Async (lookahead 1) against sync on simulated devices (generation and training stand-ins that "
         "sleep): steps per hour against the ideal speed-up")
CONFIG = "examples/configs/grpo_workplace_turn.yaml"
SCRIPTED = "policy.model_name=scripted-test-backend"
MODES = ("sync", "async")

# The full measurement: a calibration run, then 3 repeats x 2 modes of 12 steps, 4 prompts x 8 generations
# (32 rollouts, about 4,100 fake tokens a step: a Workplace rollout is 106-170), a device decoding 1,000
# tokens/s (about 4-5 s of generation a step), training calibrated to 40 % of a sync step; about 15 minutes
# on 2 cores. The smoke preset checks that it works in about a minute.
PRESETS: dict[str, dict[str, Any]] = {
    "simulated_devices": {"repeats": 3, "steps": 12, "prompts": 4, "generations": 8, "tokens_per_s": 1000.0,
                          "train_share": 0.4, "calibration_steps": 3},
    "simulated_devices_smoke": {"repeats": 1, "steps": 3, "prompts": 2, "generations": 2, "tokens_per_s": 1000.0,
                                "seconds_per_sample": 0.15, "timeout_s": 180.0},
}


def stand_in_overrides(tokens_per_s: float, seconds_per_sample: float | None) -> list[str]:
    """The scripted backend as a generation stand-in at ``tokens_per_s``; the trainer stand-in when
    ``seconds_per_sample`` is set (else the plain recording trainer, which takes no time)."""
    return [SCRIPTED, f"policy.scripted_backend.tokens_per_s={tokens_per_s:g}",
            *([f"policy.simulated_trainer.seconds_per_sample={seconds_per_sample:g}"] if seconds_per_sample else [])]


def measure(*, repeats: int, workdir: Path, steps: int = 12, prompts: int = 4, generations: int = 8,
            tokens_per_s: float = 1000.0, seconds_per_sample: float | None = None, train_share: float = 0.4,
            calibration_steps: int = 3, interval_s: float | None = None, overrides: list[str] | None = None,
            goal_ratio: float = 0.9, goal_share: tuple[float, float] = (0.30, 0.50), timeout_s: float = 600.0,
            log: Log | None = None) -> dict[str, Any]:
    log = log or make_log(NAME)
    if steps < 2:
        raise ValueError(f"{NAME} steps={steps}: at least 2 (steps 2..N are measured)")
    if not 0.0 < train_share < 1.0:
        raise ValueError(f"{NAME} train_share={train_share}: must be between 0 and 1")
    shape = [f"grpo.num_prompts_per_step={prompts}", f"grpo.num_generations_per_prompt={generations}",
             "grpo.val_period=0", "grpo.val_at_start=false",
             f"rollout_checkpointing.snapshot_attempt_interval_s={'null' if interval_s is None else interval_s}",
             *(overrides or [])]
    samples = prompts * generations
    calibration = None
    if seconds_per_sample is None:
        over = [f"grpo.max_num_steps={max(2, calibration_steps)}", *stand_in_overrides(tokens_per_s, None), *shape,
                *mode_overrides("sync", prompts)]
        run = one_run(Path(workdir) / f"{NAME}-calibration", over, timeout_s)
        g0 = run["generation_s"]
        seconds_per_sample = round(train_share / (1.0 - train_share) * g0 / samples, 4)
        calibration = {"generation_s": g0, "train_share": train_share, "seconds_per_sample": seconds_per_sample,
                       "command": run["command"], "loadavg_1m": run["loadavg_1m"]}
        log(f"calibration: a sync step generates for {g0:.2f} s -> the trainer stand-in sleeps "
            f"{seconds_per_sample * 1e3:.1f} ms per sample ({seconds_per_sample * samples:.2f} s a step)")
    stand_in = stand_in_overrides(tokens_per_s, seconds_per_sample)
    runs: list[dict[str, Any]] = []
    for r in range(repeats):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            over = [f"grpo.max_num_steps={steps}", *stand_in, *shape,
                    *(["grpo.use_generation_logprobs=true"] if mode == "sync" else []), *mode_overrides(mode, prompts)]
            w = {"repeat": r, "mode": mode, **one_run(Path(workdir) / f"{NAME}-{mode}-{r}", over, timeout_s)}
            runs.append(w)
            log(f"repeat {r + 1}/{repeats} {mode:5s}: {w['steps_per_hour']:,.0f} steps/h (step {w['step_s']:.2f} s: "
                f"generation {w['generation_s']:.2f} s, training {w['training_s']:.2f} s), lag "
                f"{w['max_group_version_lag']} (load {w['loadavg_1m'][0]:.2f})")
    res = {"name": NAME, "title": TITLE, "runs": runs, "calibration": calibration,
           "config": {"repeats": repeats, "steps": steps, "prompts": prompts, "generations": generations,
                      "samples_per_step": samples, "tokens_per_s": tokens_per_s,
                      "seconds_per_sample": seconds_per_sample, "train_share_target": train_share,
                      "interval_s": interval_s, "overrides": list(overrides or []), "config": CONFIG,
                      "stand_in_overrides": stand_in, "shape_overrides": shape,
                      "mode_overrides": {m: mode_overrides(m, prompts) for m in MODES},
                      "goal_ratio": goal_ratio, "goal_share": list(goal_share)}}
    return rederive(res)


def rederive(res: dict[str, Any]) -> dict[str, Any]:
    """Pairs, rows and the goal from the stored runs (also ``--render`` of an older result)."""
    c = res["config"]
    res["pairs"] = pairs_of(res["runs"])
    res["rows"] = rows_of(res["runs"], res["pairs"])
    res["goal"] = goal_of(res["rows"], res["pairs"], goal_ratio=c["goal_ratio"], goal_share=tuple(c["goal_share"]))
    return res


# -- one run -----------------------------------------------------------------------------------------
def one_run(root: Path, overrides: list[str], timeout_s: float) -> dict[str, Any]:
    """One GRPO run of ``CONFIG`` to its end (every process of it gone when this returns) and its figures
    over steps 2..N. Raises naming the run's output if it did not finish."""
    root = fresh_dir(Path(root))
    dirs = RunDirs(root)
    args = ["--config", CONFIG, *dirs.overrides(), "logger.plot=false", *overrides]
    load_before = os.getloadavg()[0]
    outcome = run_once(args, env=run_env(marker=new_marker()), stdout_path=root / "run.out",
                       stderr_path=root / "run.out", timeout_s=timeout_s)
    command = " ".join(["python", "examples/run_grpo.py", *args])
    if outcome.returncode != 0 or outcome.killed_by:
        why = f"stopped after {timeout_s:g} s" if outcome.killed_by == "timeout" else f"exited {outcome.returncode}"
        raise RuntimeError(f"{NAME}: run {why}; see {root / 'run.out'}:\n{outcome.tail()}")
    metrics = [m for m in dirs.records("metrics.jsonl") if m.get("step", 0) >= 1 and "step_s" in m]
    later = [m for m in metrics if m["step"] >= 2]
    if not later:
        raise RuntimeError(f"{NAME}: no step after the first in {dirs.logs / 'metrics.jsonl'} of `{command}`")

    def mean(key: str) -> float:
        return statistics.fmean(float(m.get(key) or 0.0) for m in later)

    total = sum(float(m["step_s"]) for m in later)
    return {
        "command": command, "wall_s": outcome.wall_s, "stragglers": list(outcome.leftover),
        "loadavg_1m": [load_before, os.getloadavg()[0]], "steps": len(metrics), "measured_steps": len(later),
        "steps_per_hour": 3600.0 * len(later) / total, "step_s": total / len(later),
        "generation_s": mean("generation_s"), "training_s": mean("training_s"),
        "other_s": total / len(later) - mean("generation_s") - mean("training_s"),
        "samples_per_step": mean("num_samples"),
        "max_group_version_lag": max(int(m.get("max_group_version_lag") or 0) for m in metrics),
        "per_step": [{k: m.get(k) for k in ("step", "step_s", "generation_s", "training_s", "refit_s", "checkpoint_s",
                                             "num_samples", "inflight_rollouts", "max_group_version_lag")}
                     for m in metrics],
    }


# -- results ------------------------------------------------------------------------------------------
def ideal_speedup(g: float, t: float) -> float:
    """Lookahead 1 overlaps a step's generation with the previous step's training: a sync step of g + t
    becomes max(g, t) at best."""
    return (g + t) / max(g, t)


def pairs_of(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per repeat: the measured speed-up, the ideal from the same repeat's sync run, and their ratio."""
    by = {(w["repeat"], w["mode"]): w for w in runs}
    out = []
    for r in sorted({w["repeat"] for w in runs}):
        s, a = by.get((r, "sync")), by.get((r, "async"))
        if not s or not a:
            continue
        g, t = s["generation_s"], s["training_s"]
        measured, ideal = a["steps_per_hour"] / s["steps_per_hour"], ideal_speedup(g, t)
        out.append({"repeat": r, "g_s": g, "t_s": t, "training_share": t / s["step_s"], "measured": measured,
                    "ideal": ideal, "ratio": measured / ideal})
    return out


def rows_of(runs: list[dict[str, Any]], pairs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for mode in MODES:
        ws = [w for w in runs if w["mode"] == mode]
        rows.append({
            "mode": mode, "runs": len(ws), "steps_per_hour": summary(w["steps_per_hour"] for w in ws),
            "step_s": summary(w["step_s"] for w in ws), "generation_s": summary(w["generation_s"] for w in ws),
            "training_s": summary(w["training_s"] for w in ws), "other_s": summary(w["other_s"] for w in ws),
            "training_share": summary(w["training_s"] / w["step_s"] for w in ws),
            "speedup": summary(p["measured"] for p in pairs) if mode == "async" else None,
            "ideal": summary(p["ideal"] for p in pairs) if mode == "async" else None,
            "ratio": summary(p["ratio"] for p in pairs) if mode == "async" else None,
            "max_group_version_lag": max((w["max_group_version_lag"] for w in ws), default=None),
            "loadavg_1m": summary(x for w in ws for x in w["loadavg_1m"]),
        })
    return rows


def goal_of(rows: list[dict[str, Any]], pairs: list[dict[str, Any]], *, goal_ratio: float,
            goal_share: tuple[float, float]) -> dict[str, Any]:
    ratio = summary(p["ratio"] for p in pairs)
    share = summary(p["training_share"] for p in pairs)
    lo, hi = goal_share
    return {"ratio_min": goal_ratio, "ratio": ratio, "ratio_met": None if ratio["median"] is None
            else ratio["median"] >= goal_ratio, "every_repeat_met": None if not pairs
            else all(p["ratio"] >= goal_ratio for p in pairs), "share_range": [lo, hi], "training_share": share,
            "share_in_range": None if share["median"] is None else lo <= share["median"] <= hi,
            "speedup": summary(p["measured"] for p in pairs), "ideal": summary(p["ideal"] for p in pairs)}


def table(res: dict[str, Any]) -> str:
    head = ["mode", "steps / hour (steps 2–N)", "step s", "generation s", "training s", "other s", "training share",
            "async / sync (same repeat)", "ideal (g + t) / max(g, t)", "measured / ideal", "max group lag"]
    body = []
    for r in res["rows"]:
        body.append([r["mode"], fmt(r["steps_per_hour"]), fmt(r["step_s"], 1, 2), fmt(r["generation_s"], 1, 2),
                     fmt(r["training_s"], 1, 2), fmt(r["other_s"], 1, 2), fmt(r["training_share"], 100, 0) + " %",
                     "—" if not r["speedup"] else "x" + fmt(r["speedup"], 1, 2),
                     "—" if not r["ideal"] else "x" + fmt(r["ideal"], 1, 2),
                     "—" if not r["ratio"] else fmt(r["ratio"], 1, 2), r["max_group_version_lag"]])
    c = res["config"]
    loads = [x for w in res["runs"] for x in w["loadavg_1m"]]
    cal = res.get("calibration")
    out = [f"{c['repeats']} repeat(s) of {c['steps']} steps, {c['prompts']} prompts x {c['generations']} generations; "
           f"generation stand-in at {c['tokens_per_s']:g} tokens/s, trainer stand-in "
           f"{c['seconds_per_sample'] * 1e3:g} ms per sample"
           + (f" (calibrated: a sync step generated for {cal['generation_s']:.2f} s, training aimed at "
              f"{cal['train_share'] * 100:g} %)" if cal else "")
           + ("; snapshots off" if c["interval_s"] is None else f"; snapshots every {c['interval_s']:g} s"), "",
           md_table(head, body), "",
           "g and t: mean generation_s and training_s over steps 2–N of the same repeat's sync run; other = step_s "
           "− generation_s − training_s (refit, checkpoint, bookkeeping). Measured / ideal per repeat: "
           + (", ".join(f"{p['measured']:.2f} / {p['ideal']:.2f} = {p['ratio']:.2f}" for p in res["pairs"]) or "—")
           + f". 1-minute load average around the runs: {fmt(summary(loads), 1, 2)}.", "", verdict(res["goal"])]
    return "\n".join(out)


def verdict(g: dict[str, Any]) -> str:
    def yes(v: bool | None) -> str:
        return "not measured" if v is None else ("met" if v else "NOT met")

    lo, hi = g["share_range"]
    return (f"Async on simulated devices: async / sync at least {g['ratio_min']:g} of the ideal: {yes(g['ratio_met'])} "
            f"(median {fmt(g['ratio'], 1, 2, spread=False)}: x{fmt(g['speedup'], 1, 2, spread=False)} measured "
            f"against x{fmt(g['ideal'], 1, 2, spread=False)} ideal; every repeat: {yes(g['every_repeat_met'])}); "
            f"training {lo * 100:g}–{hi * 100:g} % of a sync step: {yes(g['share_in_range'])} "
            f"({fmt(g['training_share'], 100, 0)} %).")


def plot(res: dict[str, Any], path: Path) -> Path:
    """Steps per hour of each run by repeat, and measured against ideal speed-up per repeat."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    repeats = sorted({w["repeat"] for w in res["runs"]})
    width = 0.38
    for mi, (mode, color) in enumerate((("sync", "C7"), ("async", "C0"))):
        by = {w["repeat"]: w for w in res["runs"] if w["mode"] == mode}
        xs = [i + (mi - 0.5) * width for i in range(len(repeats))]
        left.bar(xs, [by[r]["steps_per_hour"] if r in by else 0.0 for r in repeats], width, color=color, label=mode)
    left.set_xticks(range(len(repeats)))
    left.set_xticklabels([f"repeat {r + 1}" for r in repeats])
    left.set_ylabel("steps per hour (steps 2–N)")
    left.set_title("Steps per hour on simulated devices", fontsize=9)
    pairs = res["pairs"]
    xs = list(range(len(pairs)))
    right.bar([x - width / 2 for x in xs], [p["measured"] for p in pairs], width, color="C0", label="measured")
    right.bar([x + width / 2 for x in xs], [p["ideal"] for p in pairs], width, color="C2", label="ideal (g+t)/max(g,t)")
    for x, p in zip(xs, pairs):
        right.text(x, max(p["measured"], p["ideal"]), f"{p['ratio']:.2f}", ha="center", va="bottom", fontsize=8)
    right.axhline(1.0, color="black", linewidth=0.8)
    right.set_xticks(xs)
    right.set_xticklabels([f"repeat {p['repeat'] + 1}" for p in pairs])
    right.set_ylabel("async / sync")
    right.set_title("Speed-up, measured against ideal (labels: measured / ideal)", fontsize=9)
    for ax in (left, right):
        ax.legend(fontsize=7)
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- command line -----------------------------------------------------------------------------------------
def write(res: dict[str, Any], meta: dict[str, Any], out: Path) -> None:
    """``<out>/simulated_devices.{json,md,png}``."""
    out.mkdir(parents=True, exist_ok=True)
    plot(res, out / f"{NAME}.png")
    (out / f"{NAME}.json").write_text(json.dumps({"meta": meta, "result": res}, indent=1) + "\n")
    (out / f"{NAME}.md").write_text("\n".join([
        f"# {res['title']}", "", f"Command: `{meta['command']}`  ",
        f"Machine: {meta['machine'].get('cpus')} CPUs, Python {meta['machine'].get('python')}  ",
        f"Total time: {meta['seconds'] / 60:.1f} min", "", table(res), "", f"![{NAME}]({NAME}.png)", ""]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="simulated_devices")
    p.add_argument("--out", default="bench_results/simulated_devices", help="where the JSON, markdown and PNG go")
    p.add_argument("--workdir", default=None, help="scratch space (default: a temp dir, removed at the end)")
    p.add_argument("--keep-workdir", action="store_true", help="keep the runs' logs and checkpoints")
    p.add_argument("--render", default=None, metavar="JSON", help="measure nothing: redraw from a stored result")
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    if args.render:
        data = json.loads(Path(args.render).read_text())
        res = rederive(data["result"])
        write(res, data["meta"], out)
        print(table(res), flush=True)
        return 0
    workdir = Path(args.workdir).resolve() if args.workdir else Path(tempfile.mkdtemp(prefix="bench-simulated-"))
    log = make_log(NAME)
    started = time.monotonic()
    params = PRESETS[args.preset]
    log(f"{args.preset}: {params}; scratch in {workdir} (load average {os.getloadavg()[0]:.2f})")
    try:
        res = measure(workdir=workdir, log=log, **params)
    finally:
        if not args.workdir and not args.keep_workdir:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
    meta = {"preset": args.preset, "parameters": params, "machine": machine_info(),
            "command": " ".join(["python", "examples/bench/simulated_devices.py",
                                 *(argv if argv is not None else sys.argv[1:])]),
            "started_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "seconds": time.monotonic() - started}
    write(res, meta, out)
    print(f"\n## {res['title']}\n\n{table(res)}\n", flush=True)
    log(f"done in {meta['seconds'] / 60:.1f} min; wrote {out / (NAME + '.json')}, .md and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
