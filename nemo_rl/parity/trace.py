"""What each step trained, sample by sample: the record recovery parity compares (``grpo.deterministic``).

With ``grpo.deterministic`` on, the controller writes ``<logger.log_dir>/trained/step_<N>.jsonl`` once the
trainer has taken step N's samples, before the step's checkpoint: a header line (step, sample count,
pid, time), then one line per sample in the order the trainer took them (``canonical_order``: group
position, then sibling index) with its group, sibling, rollout id, reward, advantage and, per model
call, the token ids (prompt + generation), the loss mask over them (1: trained) and the generation
logprobs with their weight version.

A step trained again after a relaunch (its checkpoint never published) writes its file again, replacing
the first (an atomic rename): what is left is the lineage that survived. The file is written before the
checkpoint, so a step whose checkpoint exists has its file.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nemo_rl.experience.sample import RolloutSample
from nemo_rl.utils.atomic_write import PLAIN_FILES, write_bytes_atomic

TRACE_DIR = "trained"
FORMAT = "nemo_rl.trained_step.v1"
_POSITION = re.compile(r"p([0-9]+)$")
_STEP_FILE = re.compile(r"^step_([0-9]+)\.jsonl$")


def group_position(group_id: str) -> int | None:
    """The prompt position of an RL group id (``s{target}p{position}``), else None."""
    m = _POSITION.search(group_id)
    return int(m[1]) if m else None


def canonical_order(samples: Iterable[RolloutSample]) -> list[RolloutSample]:
    """Samples by group position (then group id, for ids of another shape), then sibling index: the one
    order a deterministic trainer takes them in, whatever order they completed in."""
    def key(s: RolloutSample) -> tuple:
        pos = group_position(s.group_id)
        return (pos is None, pos or 0, s.group_id, s.generation_index)

    return sorted(samples, key=key)


@dataclass
class TracedCall:
    token_ids: list[int]
    loss_mask: list[int]  # per token of token_ids: 1 where the loss is taken (the generated tokens)
    logprobs: list[float]  # the generation's logprob of each generated token
    weight_version: int


@dataclass
class TracedSample:
    group_id: str
    sibling: int
    rollout_id: str
    reward: float
    advantage: float | None
    calls: list[TracedCall] = field(default_factory=list)


@dataclass
class StepTrace:
    step: int
    samples: list[TracedSample]
    pid: int = 0
    written_at: float = 0.0


def trace_samples(samples: Sequence[RolloutSample], advantages: Sequence[float | None]) -> list[TracedSample]:
    """Each sample as trained, with its advantage (same order as ``samples``)."""
    if len(samples) != len(advantages):
        raise ValueError(f"{len(samples)} samples but {len(advantages)} advantages")
    out = []
    for s, adv in zip(samples, advantages):
        calls = [TracedCall(c.prompt_token_ids + c.generation_token_ids,
                            [0] * len(c.prompt_token_ids) + [1] * len(c.generation_token_ids),
                            list(c.generation_log_probs), c.weight_version) for c in s.calls]
        out.append(TracedSample(s.group_id, s.generation_index, s.rollout_id, float(s.reward),
                                None if adv is None else float(adv), calls))
    return out


def step_file(log_dir: str | os.PathLike, step: int) -> Path:
    return Path(log_dir) / TRACE_DIR / f"step_{step:06d}.jsonl"


def write_step_trace(log_dir: str | os.PathLike, step: int, samples: Sequence[TracedSample]) -> Path:
    """Write (or replace) step ``step``'s record; a failed write raises ``RunWriteError`` naming the file."""
    path = step_file(log_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    head = {"format": FORMAT, "step": step, "samples": len(samples), "pid": os.getpid(), "written_at": time.time()}
    lines = [json.dumps(head)] + [json.dumps(asdict(s)) for s in samples]
    write_bytes_atomic(path, ("\n".join(lines) + "\n").encode(), PLAIN_FILES)
    return path


def read_step_trace(path: str | os.PathLike) -> StepTrace:
    """One step's record; ``ValueError`` naming the file and line for one that is not this format."""
    path = Path(path)
    lines = path.read_text().splitlines()
    try:
        head = json.loads(lines[0])
        if head.get("format") != FORMAT:
            raise ValueError(f"format is {head.get('format')!r}, expected {FORMAT!r}")
        samples = []
        for n, line in enumerate(lines[1:], start=2):
            raw: dict[str, Any] = json.loads(line)
            calls = [TracedCall(**c) for c in raw.pop("calls")]
            samples.append(TracedSample(**raw, calls=calls))
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise ValueError(f"{path}: not a trained-step record ({exc})") from None
    if len(samples) != head["samples"]:
        raise ValueError(f"{path}: the header says {head['samples']} samples but {len(samples)} follow")
    return StepTrace(int(head["step"]), samples, int(head.get("pid", 0)), float(head.get("written_at", 0.0)))


def read_step_traces_steps(log_dir: str | os.PathLike) -> list[int]:
    """The steps that have a record under ``log_dir`` (names only: nothing is read)."""
    directory = Path(log_dir) / TRACE_DIR
    return sorted(int(m[1]) for p in directory.iterdir() if (m := _STEP_FILE.match(p.name))) \
        if directory.is_dir() else []


def read_step_traces(log_dir: str | os.PathLike) -> dict[int, StepTrace]:
    """Every step's record under ``log_dir`` (the surviving lineage), by step."""
    found = {}
    directory = Path(log_dir) / TRACE_DIR
    for path in sorted(directory.iterdir()) if directory.is_dir() else []:
        m = _STEP_FILE.match(path.name)
        if m:
            found[int(m[1])] = read_step_trace(path)
    return found


def trace_of_step(trainer: Any, samples: Sequence[RolloutSample], normalize_rewards: bool) -> list[TracedSample]:
    """What step's trainer took: its own record (``last_trace``, the GRPO trainer's) or, for a trainer that
    keeps none (the recording trainer), ``samples`` in canonical order with GRPO's advantages."""
    own = getattr(trainer, "last_trace", None)
    if own is not None:
        return list(own)
    from nemo_rl.algorithms.grpo import compute_group_advantages

    ordered = canonical_order(samples)
    groups: dict[str, list[RolloutSample]] = {}
    for s in ordered:
        groups.setdefault(s.group_id, []).append(s)
    advs = compute_group_advantages([[s.reward for s in g] for g in groups.values()], normalize=normalize_rewards)
    return trace_samples([s for g in groups.values() for s in g], [a for g in advs for a in g])
