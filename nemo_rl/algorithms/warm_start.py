"""Supervised warm start on demonstrations built from dataset rows.

A policy trained from scratch never emits a well-formed tool call by chance,
so GRPO would see reward 0 everywhere and learn nothing. A short supervised
phase on each row's ``ground_truth`` calls (tool outputs simulated with the
row's own world, final reply ``final_answer``) teaches the format and the task
shapes; kept short on purpose, it leaves the policy sloppy enough that RL has
room to improve it.

Tool outputs come from Gym's client surface, ``gym_patches.demonstrations``: it plays
each row's calls through its task source's own tool code (the workplace
``OfficeWorld``, a live interpreter session for python_sandbox, the verifier's
``calculate`` for arithmetic, or a replay a resources server registered), so the
demonstrations show exactly what rollouts show, and RL imports no resources
server. A row of any other task source carries its tool outputs itself
(``ground_truth_outputs``, one string per call) or has no calls;
``check_demonstrable`` says which rows have neither before a run starts anything
(docs/design.md §5.6).
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from gym_patches.demonstrations import ground_truth_outputs, row_task_source, task_sources
from nemo_rl.models.chat import render_with_mask


# task_source -> simulator over a list of rows (one list of tool outputs per row): the ``simulators=``
# override of ``check_demonstrable`` / ``simulate_rows``; any other task source is Gym's
# (``gym_patches.demonstrations``).
BatchSimulator = Callable[[list[dict]], list[list[str]]]
# A row field that makes any row demonstrable: the output of each ground_truth call, in order.
OUTPUTS_FIELD = "ground_truth_outputs"


def _check_row(row: Any, i: int) -> dict:
    if not isinstance(row, dict):
        raise ValueError(f"rows[{i}] must be a dict, got {type(row).__name__}")
    for key in ("responses_create_params", "ground_truth"):
        if key not in row:
            raise ValueError(f"rows[{i}] (id {row.get('id')!r}) has no field {key!r}")
    if not isinstance(row["responses_create_params"].get("input"), list):
        raise ValueError(f"rows[{i}] field 'responses_create_params.input' must be a list of messages")
    if not isinstance(row["ground_truth"], list):
        raise ValueError(f"rows[{i}] (id {row.get('id')!r}) field 'ground_truth' must be a list of calls")
    for j, call in enumerate(row["ground_truth"]):
        if not isinstance(call, dict) or "name" not in call or "arguments" not in call:
            raise ValueError(f"rows[{i}] field 'ground_truth[{j}]' needs 'name' and 'arguments'")
    outs = row.get(OUTPUTS_FIELD)
    if outs is not None and (not isinstance(outs, list) or len(outs) != len(row["ground_truth"])
                             or not all(isinstance(o, str) for o in outs)):
        raise ValueError(f"rows[{i}] (id {row.get('id')!r}) field {OUTPUTS_FIELD!r} must be a list of "
                         f"{len(row['ground_truth'])} strings, one per ground_truth call")
    return row


def _simulator_names(simulators: dict[str, BatchSimulator] | None) -> list[str]:
    """The task sources whose tool outputs can be simulated: Gym's replays and the overrides."""
    return sorted({*task_sources(), *(simulators or {})})


def _needs_simulator(row: dict) -> bool:
    return bool(row["ground_truth"]) and row.get(OUTPUTS_FIELD) is None


def check_demonstrable(rows: Iterable[Any], source: str = "rows",
                       simulators: dict[str, BatchSimulator] | None = None) -> None:
    """Raise ``ValueError`` (naming ``source``, the task sources and what to do) unless every row can
    become a demonstration. Reads the rows only: no simulator runs, so it is cheap enough for startup."""
    sims = _simulator_names(simulators)
    missing: dict[str, list[Any]] = {}
    for i, row in enumerate(rows):
        try:
            _check_row(row, i)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None
        src = row_task_source(row)
        if _needs_simulator(row) and src not in sims:
            missing.setdefault(src, []).append(row.get("id", f"rows[{i}]"))
    if missing:
        which = "; ".join(f"task_source {src!r} ({len(ids)} rows, e.g. {ids[0]!r})" for src, ids in missing.items())
        raise ValueError(
            f"{source}: the warm start cannot build demonstrations for {which}: their ground_truth calls need "
            f"tool outputs and there is no tool simulator for that task source (have {sorted(sims)}). Give those "
            f"rows a {OUTPUTS_FIELD!r} field (the output of each ground_truth call, in order), or train a model "
            f"of your own (policy.model_name=<hub id or directory>: no warm start)")


def _args_dict(arguments: Any) -> dict:
    return json.loads(arguments) if isinstance(arguments, str) else dict(arguments)


def demo_messages(row: dict, tool_outputs: Sequence[str]) -> list[dict]:
    """The demonstration conversation: one assistant turn per ground-truth call, then the final answer."""
    msgs = [dict(m) for m in row["responses_create_params"]["input"]]
    for i, (call, out) in enumerate(zip(row["ground_truth"], tool_outputs, strict=True)):
        call_id = f"call_demo_{i}"
        args = json.dumps(_args_dict(call["arguments"]))
        msgs.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": call["name"], "arguments": args}}]})
        msgs.append({"role": "tool", "tool_call_id": call_id, "content": out})
    msgs.append({"role": "assistant", "content": row.get("final_answer") or "Done."})
    return msgs


def simulate_rows(rows: Iterable[dict], simulators: dict[str, BatchSimulator] | None = None) -> list[list[dict]]:
    """Demonstration conversations for ``rows``, in order (tool outputs simulated per task source)."""
    sims = _simulator_names(simulators)
    rows = [_check_row(r, i) for i, r in enumerate(rows)]
    by_source: dict[str, list[int]] = {}
    outputs: dict[int, list[str]] = {}
    for i, row in enumerate(rows):
        if not _needs_simulator(row):  # no calls, or outputs given in the row
            outputs[i] = list(row.get(OUTPUTS_FIELD) or [])
            continue
        src = row_task_source(row)
        if src not in sims:
            raise ValueError(f"rows[{i}] has task_source {src!r}; no tool simulator for it (have {sorted(sims)}) "
                             f"and no {OUTPUTS_FIELD!r} field")
        by_source.setdefault(src, []).append(i)
    for src, idx in by_source.items():
        group = [rows[i] for i in idx]
        simulated = simulators[src](group) if simulators and src in simulators else ground_truth_outputs(group, src)
        for i, outs in zip(idx, simulated, strict=True):
            outputs[i] = outs
    return [demo_messages(row, outputs[i]) for i, row in enumerate(rows)]


def _batch(examples: list[tuple[list[int], list[int]]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), T - 1))
    for i, (x, m) in enumerate(examples):
        ids[i, : len(x)] = torch.tensor(x)
        mask[i, : len(x) - 1] = torch.tensor(m[1:], dtype=torch.float32)  # logprob j scores token j+1
    return ids.to(device), mask.to(device)


def row_tools(row: dict) -> list[dict] | None:
    return row["responses_create_params"].get("tools") or None


def demonstration_examples(policy, rows: Sequence[dict], conversations: list[list[dict]]) -> list[tuple[list[int], list[int]]]:
    """(ids, assistant mask) per demonstration, rendered by the policy's chat template with the row's tools."""
    return [render_with_mask(policy.tokenizer, c, row_tools(r), policy.stop_ids)
            for r, c in zip(rows, conversations, strict=True)]


def warm_start(
    policy,
    rows: Sequence[dict],
    steps: int = 800,
    batch_size: int = 16,
    lr: float = 5e-3,
    seed: int = 0,
    label_smoothing: float = 0.025,
    conversations: list[list[dict]] | None = None,
    progress: bool = False,
    log_every: int = 0,
    log: Callable[[str], None] = print,
) -> dict[str, float]:
    """Train ``policy`` (an ``HFPolicy``) in place on demonstrations (loss on assistant tokens only).

    ``conversations`` may be passed to reuse demonstrations already simulated
    (``simulate_rows``); otherwise they are built from ``rows``. ``progress``
    shows a bar (step, loss).
    """
    if steps < 0 or batch_size < 1:
        raise ValueError(f"warm_start needs steps >= 0 and batch_size >= 1, got {steps}/{batch_size}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    t0 = time.perf_counter()
    rows = list(rows)
    convs = conversations if conversations is not None else simulate_rows(rows)
    if not convs:
        raise ValueError("warm_start needs at least one row")
    examples = demonstration_examples(policy, rows, convs)
    too_long = [i for i, (ids, _) in enumerate(examples) if len(ids) > policy.max_seq_len]
    if too_long:
        raise ValueError(f"demonstrations {too_long[:5]} exceed policy.max_seq_len={policy.max_seq_len}")
    rng = random.Random(seed)
    opt = torch.optim.AdamW(policy.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / max(steps, 1)))
    )
    policy.train()
    loss_v = float("nan")
    bar = None
    if progress and steps:
        from tqdm import tqdm

        bar = tqdm(total=steps, desc="warm start", unit="step", dynamic_ncols=True,
                   mininterval=1.0 if os.isatty(2) else 30.0)
    try:
        for step in range(steps):
            ids, mask = _batch(rng.sample(examples, min(batch_size, len(examples))), policy.pad_id, policy.device)
            logp = torch.log_softmax(policy.logits(ids)[:, :-1].float(), dim=-1)
            nll = -logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
            if label_smoothing > 0:  # keep some mass on every token: exploration left for RL
                nll = (1 - label_smoothing) * nll - label_smoothing * logp.mean(-1)
            loss = (nll * mask).sum() / mask.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            opt.step()
            sched.step()
            loss_v = loss.item()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss_v:.3f}", refresh=False)
            if log_every and (step + 1) % log_every == 0:
                log(f"warm_start step {step + 1}/{steps} loss {loss_v:.4f}")
    finally:
        if bar is not None:
            bar.close()
    policy.eval()
    return {"warm_start_loss": loss_v, "warm_start_steps": float(steps), "warm_start_s": time.perf_counter() - t0,
            "num_demos": float(len(examples))}
