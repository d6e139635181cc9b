"""Measurement 15: a relaunch with a model of about 1 GB, what it reads of the trainer step and what it
ships to generation, with the time to its first dispatched rollout by phase.

The benchmark first builds the model in its workdir, with no hub: the embedded model's tokenizer recipe
(``nemo_rl.models.tiny_model``: byte-level BPE trained on the Workplace rows, its chat template) and a
randomly initialised Qwen3 with ``hidden_size`` and as many layers as make about ``model_mb`` MiB of
float32 weights, written with ``save_pretrained``. Each repeat is then two real ``examples/run_grpo.py``
processes on ``examples/configs/grpo_workplace_turn.yaml`` with ``policy.model_name=<that directory>``
(the real GRPO trainer, the torch generation worker, Workplace Gym), started and reaped through the run
harness, with the same command:

1. the first launch, SIGKILLed as a whole process group once ``snapshots.jsonl`` shows a committed
   snapshot under trainer step >= 1 (``anchor_step``: ``step_N`` is durable and the snapshot rests on it);
2. the relaunch, SIGKILLed once its ``startup.json`` exists (its first rollout was dispatched).

What the relaunch did, counted from outside the product, so the same command measures any commit
(``product``: another checkout runs, this one's benchmark counts):

- reads: every open of each file of the trainer step directories (``testkit/file_opens.py``, inotify;
  any process). Every reader of such a file reads it whole (the restore lookup's hash, safetensors,
  ``torch.load``), so *bytes read* = opens x size. The weights are read through a memory map, which
  ``rchar`` does not count; the driver's ``rchar`` (``/proc/<pid>/io`` at the kill) is shown beside.
- shipped: every shipment of weights the generation worker received, at its construction and at each
  refit (``BENCH_WEIGHTS_LOG`` of ``instrument/sitecustomize.py``), up to the first dispatch.
- time: ``startup.json``'s phases (``nemo_rl/utils/startup_clock.py``), as measurement 7 reads them.

Each repeat's checkpoint directory (gigabytes: the weights, the KL reference and Adam's moments) is removed
once measured; its logs stay. The model is built once per workdir (``--workdir`` keeps it for another run).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from bench.common import INSTRUMENT, REPO, Log, fmt, fresh_dir, load_rows, make_log, md_table, summary
from bench.relaunch import PHASE_LABELS, read_startup
from nemo_rl.utils.startup_clock import PHASES
from testkit.file_opens import FileOpens
from testkit.run_harness import JsonlFollower, new_marker, processes_with_marker, run_env, run_once

NAME = "restore_io"
TITLE = "15. Relaunch with a ~1 GB model: reads of the trainer step, weights shipped to generation, time by phase"
CONFIG = "examples/configs/grpo_workplace_turn.yaml"
KINDS = (("first", "first launch"), ("relaunch", "relaunch after SIGKILL"))
MAX_READS, MAX_SHIPS = 2, 1  # of each file of the restored step; of the weights, to generation
MB = 1 << 20
POLL_S = 0.05


# -- the model -------------------------------------------------------------------------------------
def build_model(directory: Path, *, model_mb: float, hidden_size: int) -> dict[str, Any]:
    """A Qwen3 of about ``model_mb`` MiB of float32 weights with the embedded model's tokenizer recipe,
    saved into ``directory`` (reused when it is already there, built for the same sizes)."""
    marker = directory / "bench_model.json"
    wanted = {"model_mb": model_mb, "hidden_size": hidden_size}
    if marker.exists() and json.loads(marker.read_text()).get("wanted") == wanted:
        return json.loads(marker.read_text())
    from nemo_rl.models.policy_config import TinyModelRecipe
    from nemo_rl.models.tiny_model import init_model, tokenizer_corpus, train_tokenizer

    rows = load_rows("workplace_train.jsonl")
    tok = train_tokenizer([*tokenizer_corpus(rows, []), *(json.dumps(r["responses_create_params"]) for r in rows)],
                          2000)
    head_dim = 64 if hidden_size >= 512 else 32
    per_layer = 4 * hidden_size * hidden_size + 3 * hidden_size * 4 * hidden_size
    layers = max(1, round((model_mb * MB / 4 - len(tok) * hidden_size) / per_layer))
    recipe = TinyModelRecipe(hidden_size=hidden_size, intermediate_size=4 * hidden_size, num_layers=layers,
                             num_heads=hidden_size // head_dim, num_kv_heads=hidden_size // head_dim,
                             head_dim=head_dim, max_position_embeddings=2048)
    model = init_model(recipe, tok)
    params = sum(p.numel() for p in model.parameters())
    fresh_dir(directory)
    tok.save_pretrained(directory)
    model.save_pretrained(directory)
    info = {"wanted": wanted, "path": str(directory), "params": params, "layers": layers,
            "weights_bytes": sum(f.stat().st_size for f in directory.glob("*.safetensors"))}
    marker.write_text(json.dumps(info))
    return info


# -- one repeat --------------------------------------------------------------------------------------
def measure(*, repeats: int, workdir: Path, model_mb: float = 1024, hidden_size: int = 1024, steps: int = 3,
            prompts: int = 2, generations: int = 2, max_new_tokens: int = 16, interval_s: float = 0.5,
            overrides: list[str] | None = None, product: str | Path | None = None, timeout_s: float = 1800.0,
            log: Log | None = None) -> dict[str, Any]:
    log = log or make_log(NAME)
    workdir = Path(workdir).resolve()
    checkout = Path(product).resolve() if product else REPO
    log(f"building the model (~{model_mb:g} MiB of float32 weights, hidden size {hidden_size}); load average "
        f"{os.getloadavg()[0]:.2f}")
    model = build_model(workdir / f"{NAME}-model", model_mb=model_mb, hidden_size=hidden_size)
    log(f"model: {model['params'] / 1e6:.1f}M parameters in {model['layers']} layers, "
        f"{model['weights_bytes'] / MB:,.0f} MiB of weights; the runs are {checkout}")
    args_of = lambda run_dir: _args(run_dir, model["path"], steps, prompts, generations,  # noqa: E731
                                    max_new_tokens, interval_s, list(overrides or []))
    results = []
    for r in range(repeats):
        run_dir = fresh_dir(workdir / f"{NAME}-{r}")
        res = run_repeat(run_dir, args_of(run_dir), checkout, timeout_s)
        shutil.rmtree(run_dir / "ckpt", ignore_errors=True)  # gigabytes a repeat; its logs stay
        res["repeat"] = r
        results.append(res)
        if res.get("error"):
            log(f"repeat {r + 1}/{repeats}: {res['error']}")
        else:
            log(f"repeat {r + 1}/{repeats}: relaunch {res['relaunch']['to_first_dispatch_s']:.1f}s to the first "
                f"dispatch; weights read {res['reads']['weights_reads']}x, shipped {res['shipped']['count']}x "
                f"(load {res['loadavg_1m_at_relaunch']:.2f})")
    rows = rows_of(results)
    return {"name": NAME, "title": TITLE, "rows": rows, "repeats": results, "model": model,
            "goal": goal_of(results),
            "config": {"repeats": repeats, "model_mb": model_mb, "hidden_size": hidden_size, "max_num_steps": steps,
                       "prompts": prompts, "generations": generations, "max_new_tokens": max_new_tokens,
                       "snapshot_interval_s": interval_s, "overrides": list(overrides or []),
                       "product": str(checkout),
                       "setup": f"{CONFIG}, policy.model_name=<the built model>, the real trainer and the torch "
                                "worker; killed once a snapshot of step >= 1 was committed"}}


def _args(run_dir: Path, model: str, steps: int, prompts: int, generations: int, max_new_tokens: int,
          interval_s: float, overrides: list[str]) -> list[str]:
    return ["--config", CONFIG, f"policy.model_name={model}", f"grpo.max_num_steps={steps}",
            f"grpo.num_prompts_per_step={prompts}", f"grpo.num_generations_per_prompt={generations}",
            f"policy.generation.max_new_tokens={max_new_tokens}", "grpo.val_period=0",
            # with a KL reference every sequence trains, so the step holds Adam's moments and the reference
            "loss_fn.reference_policy_kl_penalty=0.01",
            f"rollout_checkpointing.snapshot_attempt_interval_s={interval_s}", "checkpointing.keep_top_k=1",
            f"logger.log_dir={run_dir / 'logs'}", f"checkpointing.checkpoint_dir={run_dir / 'ckpt'}",
            "logger.progress_bar=false", "logger.plot=false", *overrides]


def _env(checkout: Path, marker: str, weights_log: Path) -> dict[str, str]:
    """The run's environment: the instrumentation first on ``PYTHONPATH``, then the checkout that runs."""
    env = run_env(marker=marker, extra={"BENCH_WEIGHTS_LOG": str(weights_log)})
    env["PYTHONPATH"] = os.pathsep.join([str(INSTRUMENT), str(checkout)])
    return env


def _rchar(marker: str) -> dict[str, int]:
    """``rchar`` of the run's driver and of all its processes together, now."""
    driver = total = 0
    for pid in processes_with_marker(marker):
        try:
            io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        total += int(io.get("rchar", 0))
        if b"testkit.run_grpo" in cmd:
            driver = int(io.get("rchar", 0))
    return {"driver": driver, "all": total}


def run_repeat(run_dir: Path, args: list[str], checkout: Path, timeout_s: float) -> dict[str, Any]:
    logs, ckpt = run_dir / "logs", run_dir / "ckpt"
    startup = logs / "startup.json"
    base: dict[str, Any] = {"command": " ".join(["python", "examples/run_grpo.py", *args]), "checkout": str(checkout)}
    snaps = JsonlFollower(logs / "snapshots.jsonl")
    chosen: list[dict[str, Any]] = []

    def committed(_elapsed: float) -> bool:
        for _, snap in snaps.poll():
            # under a durable trainer step: with a large model its checkpoint is written for seconds after the
            # step trained, and snapshots taken meanwhile still hang under the step before (``anchor_step``)
            if not chosen and snap.get("committed") and int(snap.get("anchor_step") or 0) >= 1:
                chosen.append(snap)
        return bool(chosen)

    first = run_once(args, env=_env(checkout, new_marker(), run_dir / "weights-first.jsonl"), cwd=checkout,
                     stdout_path=run_dir / "first.out", stderr_path=run_dir / "first.out", kill_when=committed,
                     timeout_s=timeout_s, poll_s=POLL_S)
    if first.killed_by != "group" or read_startup(startup) is None:
        ended = first.killed_by or "exit"
        return {**base, "error": f"first launch: no committed snapshot of step >= 1 (ended: {ended}, rc "
                                 f"{first.returncode}); see {run_dir / 'first.out'}", "stragglers": first.leftover}
    first_startup = read_startup(startup)
    startup.rename(logs / "startup-first-launch.json")
    steps = sorted(ckpt.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    sizes = {f"{d.name}/{f.name}": f.stat().st_size for d in steps for f in d.iterdir() if f.is_file()}

    marker, io = new_marker(), {}

    def dispatched(_elapsed: float) -> bool:
        if read_startup(startup) is None:
            return False
        io.update(_rchar(marker))
        return True

    load = os.getloadavg()[0]
    with FileOpens(steps) as opens:
        second = run_once(args, env=_env(checkout, marker, run_dir / "weights-relaunch.jsonl"), cwd=checkout,
                          stdout_path=run_dir / "relaunch.out", stderr_path=run_dir / "relaunch.out",
                          kill_when=dispatched, timeout_s=timeout_s, poll_s=POLL_S)
        counts = opens.counts()
    relaunch_startup = read_startup(startup)
    if second.killed_by != "group" or relaunch_startup is None:
        tail = "\n".join((run_dir / "relaunch.out").read_text(errors="replace").splitlines()[-12:])
        return {**base, "error": f"relaunch: no first dispatch (ended: {second.killed_by or 'exit'}, rc "
                                 f"{second.returncode}); see {run_dir / 'relaunch.out'}", "output_tail": tail,
                "stragglers": first.leftover + second.leftover}
    restore = json.loads((logs / "restore.json").read_text()) if (logs / "restore.json").exists() else {}
    restored = f"step_{restore.get('trainer_step')}"
    dispatched_at = startup.stat().st_mtime
    return {
        **base,
        "first": first_startup,
        "relaunch": relaunch_startup,
        "crash": {"snapshot": {k: chosen[0].get(k) for k in ("checkpoint_id", "step", "commit_mode", "saved")}},
        "restored_step": restored,
        "reads": reads_of(counts, sizes, restored),
        "shipped": shipped_of(run_dir / "weights-relaunch.jsonl", dispatched_at),
        "rchar": io,
        "loadavg_1m_at_relaunch": load,
        "stragglers": first.leftover + second.leftover,
    }


def reads_of(counts: dict[str, int], sizes: dict[str, int], restored: str) -> dict[str, Any]:
    """Opens and bytes read of the restored step's files (and of any other step: none is expected)."""
    files = {name: {"opens": counts.get(name, 0), "size": size} for name, size in sizes.items()
             if name.startswith(restored + "/")}
    weights = {n: f for n, f in files.items() if n.endswith(".safetensors")}
    state = {n: f for n, f in files.items() if n.endswith((".safetensors", ".pt"))}  # weights, optimizer, ...
    return {
        "files": files,
        "weights_reads": max((f["opens"] for f in weights.values()), default=0),
        "weights_bytes": sum(f["size"] for f in weights.values()),
        "weights_read_bytes": sum(f["opens"] * f["size"] for f in weights.values()),
        "state_reads": max((f["opens"] for f in state.values()), default=0),
        "max_reads": max((f["opens"] for f in files.values()), default=0),
        "step_bytes": sum(f["size"] for f in files.values()),
        "step_read_bytes": sum(f["opens"] * f["size"] for f in files.values()),
        "other_steps_read_bytes": sum(counts.get(n, 0) * size for n, size in sizes.items()
                                      if not n.startswith(restored + "/")),
    }


def shipped_of(path: Path, until: float) -> dict[str, Any]:
    """The shipments the generation worker received up to ``until`` (the first dispatch)."""
    events = [e for e in (json.loads(line) for line in path.read_text().splitlines() if line.strip())
              if e["time"] <= until] if path.exists() else []
    return {"count": len(events), "bytes": sum(e["bytes"] for e in events),
            "events": [{k: e[k] for k in ("event", "bytes")} for e in events]}


# -- results ----------------------------------------------------------------------------------------
def _phases(results: list[dict[str, Any]]) -> list[str]:
    extra = sorted({p for r in results for k, _ in KINDS if r.get(k) for p in r[k].get("phases_s", {})} - set(PHASES))
    return [*PHASES, *extra]


def rows_of(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ok = [r for r in results if not r.get("error")]
    rows = []
    for kind, label in KINDS:
        recs = [r[kind] for r in ok]
        rows.append({"kind": kind, "label": label, "runs": len(recs),
                     "resumed": [rec.get("resumed") for rec in recs],
                     "to_first_dispatch_s": summary(rec["to_first_dispatch_s"] for rec in recs),
                     "phases_s": {p: summary(rec["phases_s"][p] for rec in recs if p in rec["phases_s"])
                                  for p in _phases(ok)}})
    rows[-1]["io"] = {
        "weights_reads": summary(r["reads"]["weights_reads"] for r in ok),
        "state_reads": summary(r["reads"]["state_reads"] for r in ok),
        "weights_bytes": summary(r["reads"]["weights_bytes"] for r in ok),
        "step_bytes": summary(r["reads"]["step_bytes"] for r in ok),
        "step_read_bytes": summary(r["reads"]["step_read_bytes"] for r in ok),
        "shipped": summary(r["shipped"]["count"] for r in ok),
        "shipped_bytes": summary(r["shipped"]["bytes"] for r in ok),
        "rchar_driver": summary(r["rchar"].get("driver", 0) for r in ok),
    }
    return rows


def goal_of(results: list[dict[str, Any]]) -> dict[str, Any]:
    # only a relaunch that restored a trainer step says anything about its reads (one that did not read nothing)
    ok = [r for r in results if not r.get("error") and r["relaunch"].get("resumed") is True]
    return {"max_reads_per_file": MAX_READS, "max_ships": MAX_SHIPS,
            "reads_met": None if not ok else all(r["reads"]["state_reads"] <= MAX_READS for r in ok),
            "ships_met": None if not ok else all(r["shipped"]["count"] <= MAX_SHIPS for r in ok),
            "most_reads": max((r["reads"]["state_reads"] for r in ok), default=None),
            "most_ships": max((r["shipped"]["count"] for r in ok), default=None),
            "relaunch_s": summary(r["relaunch"]["to_first_dispatch_s"] for r in ok),
            "every_relaunch_resumed": bool(results) and len(ok) == len([r for r in results if not r.get("error")]),
            "loadavg_1m_at_relaunch": summary(r["loadavg_1m_at_relaunch"] for r in ok),
            "errors": [r["error"] for r in results if r.get("error")]}


def verdict(goal: dict[str, Any]) -> str:
    def yes(v: Any) -> str:
        return "not measured" if v is None else ("met" if v else "NOT met")

    return (f"a relaunch reads the weights and each state file (*.safetensors, *.pt) of the restored trainer step "
            f"at most {MAX_READS} times: "
            f"{yes(goal['reads_met'])} (most {goal['most_reads']}), and ships the weights to generation at most "
            f"{MAX_SHIPS} time: {yes(goal['ships_met'])} ({goal['most_ships']}); relaunch to the first dispatch "
            f"{fmt(goal['relaunch_s'], 1, 1)} s (1-minute load average at relaunch "
            f"{fmt(goal['loadavg_1m_at_relaunch'], 1, 2)})")


def table(res: dict[str, Any]) -> str:
    phases = _phases(res["repeats"])
    head = ["launch", "runs", "resumed", "total: process start → first dispatch s",
            *(f"{PHASE_LABELS.get(p, p)} s" for p in phases)]
    body = [[r["label"], r["runs"], "/".join(sorted({str(v).lower() for v in r["resumed"]}) or ["—"]),
             fmt(r["to_first_dispatch_s"], 1, 2), *(fmt(r["phases_s"].get(p), 1, 2) for p in phases)]
            for r in res["rows"]]
    io = res["rows"][-1]["io"]
    io_table = md_table(
        ["relaunch", "weights MiB", "reads of each weights file", "most reads of a .pt file or the weights",
         "step MiB read / on disk", "weights shipped to generation (times, MiB)", "driver rchar MiB"],
        [["relaunch after SIGKILL", fmt(io["weights_bytes"], 1 / MB), fmt(io["weights_reads"]), fmt(io["state_reads"]),
          f"{fmt(io['step_read_bytes'], 1 / MB)} / {fmt(io['step_bytes'], 1 / MB)}",
          f"{fmt(io['shipped'])} ({fmt(io['shipped_bytes'], 1 / MB)})", fmt(io["rchar_driver"], 1 / MB)]])
    ok = [r for r in res["repeats"] if not r.get("error")]
    notes = [f"Model: {res['model']['params'] / 1e6:.1f}M parameters, {res['model']['weights_bytes'] / MB:,.0f} MiB "
             f"of float32 weights; runs of {res['config']['product']}."]
    if ok:
        notes.append("Reads: opens of each file of the restored step by any process (inotify), times its size (the "
                     "small files, config and tokenizer, are read more often); the weights are memory-mapped, which "
                     "the driver's rchar does not count. Shipped: weights the "
                     "generation worker received (construction and refits) up to the first dispatch. "
                     "1-minute load average at relaunch: "
                     f"{fmt(summary(r['loadavg_1m_at_relaunch'] for r in ok), 1, 2)}.")
    errors = res["goal"].get("errors") or []
    if errors:
        notes.append(f"{len(errors)} repeat(s) failed: " + "; ".join(errors))
    return md_table(head, body) + "\n\n" + io_table + "\n\n" + " ".join(notes)
