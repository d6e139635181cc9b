"""Compare what two deterministic runs trained, step by step, and name the first difference.

Per step (``trace`` records; the surviving lineage): the groups trained, and per sample in trained order
its group and sibling, reward, advantage and per model call the token ids, loss mask, logprobs and weight
version. Exact: groups, order, token ids, masks, rewards, weight versions. Within ``Tolerance``
(|a - b| <= atol + rtol * |b|): logprobs, advantages and the step's metrics (``metrics.jsonl``, the last
row of each step; timings, snapshot and recovery bookkeeping, prefix-continuation counts and validation
are not compared: they follow the faults). Tool effects: the tokens a rollout's session added between two
of its model calls (what its tools answered) must be there once per call that reached them and equal.
The final weights (the newest ``step_N`` of each checkpoint directory) must be equal, or the largest
difference is named.

Async mode (a lookahead above 0): a call's tokens are reproducible only for the weights that made them,
and which version a call ran at follows timing; samples are compared where every call's version is the
same in both runs, and once a step trained on other versions the weights differ and nothing after it is
comparable: the report says from which step, and why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_rl.parity.trace import StepTrace, TracedSample, read_step_traces
from nemo_rl.utils.jsonl_rows import read_rows

NOT_COMPARED = ("inflight_rollouts", "row_restored", "num_adds", "max_group_version_lag")
# Bookkeeping that follows the faults: snapshot counts, prefix continuations, validation (its rollouts are not
# seeded by rollout), the in-run recovery's supervisor/* and gen_fleet/* (upstream's names).
NOT_COMPARED_PREFIXES = ("snapshot", "prefix_", "val_", "supervisor/", "gen_fleet/")


@dataclass(frozen=True)
class Tolerance:
    rtol: float = 1e-5
    atol: float = 1e-6

    def close(self, a: float, b: float) -> bool:
        return abs(a - b) <= self.atol + self.rtol * abs(b)


@dataclass
class Difference:
    """The first thing that differs: where (step, group, sample, call, token) and what."""

    step: int
    what: str
    group: str | None = None
    sample: int | None = None  # sibling index
    rollout: str | None = None
    call: int | None = None
    token: int | None = None
    reference: Any = None
    faulted: Any = None

    def line(self) -> str:
        where = [f"step {self.step}"]
        if self.group is not None:
            where.append(f"group {self.group}")
        if self.sample is not None:
            where.append(f"sample {self.sample}" + (f" ({self.rollout})" if self.rollout else ""))
        if self.call is not None:
            where.append(f"call {self.call}")
        if self.token is not None:
            where.append(f"token {self.token}")
        return f"{', '.join(where)}: {self.what}: reference {self.reference!r}, under faults {self.faulted!r}"


@dataclass
class StepRow:
    step: int
    groups: int = 0
    samples: int = 0
    tokens: int = 0  # token ids compared
    token_ids: str = "-"  # "exact" / "differ" / "-"
    masks: str = "-"
    rewards: str = "-"
    logprobs_max: float = 0.0
    advantages_max: float = 0.0
    metrics_max: float = 0.0  # the largest |difference| of a compared metric
    tool_effects: int = 0  # tool outputs compared (each once per rollout that reached it)
    versions: str = "-"  # async: samples compared / all
    verdict: str = "ok"


@dataclass
class WeightsResult:
    step_dir: str | None
    tensors: int = 0
    max_abs: float = 0.0
    worst: str | None = None
    note: str | None = None

    @property
    def exact(self) -> bool:
        return self.note is None and self.max_abs == 0.0


@dataclass
class ParityReport:
    rows: list[StepRow] = field(default_factory=list)
    weights: WeightsResult | None = None
    first: Difference | None = None
    notes: list[str] = field(default_factory=list)
    tolerance: Tolerance = field(default_factory=Tolerance)
    not_comparable_from: int | None = None  # async: the first step trained on other versions

    @property
    def ok(self) -> bool:
        return self.first is None and (self.weights is None or self.weights.exact)


# ----------------------------------------------------------------------------- samples
def _first_mismatch(a: list, b: list) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def tool_outputs(sample: TracedSample) -> list[list[int]]:
    """The tokens the session added between consecutive calls (what its tools answered): call k+1's
    prompt after the longest prefix it shares with call k's tokens."""
    out = []
    for prev, nxt in zip(sample.calls, sample.calls[1:]):
        prompt = nxt.loss_mask.index(1) if 1 in nxt.loss_mask else len(nxt.token_ids)
        shared = _first_mismatch(prev.token_ids, nxt.token_ids[:prompt])
        start = min(len(prev.token_ids), prompt) if shared is None else shared
        out.append(nxt.token_ids[start:prompt])
    return out


class _StepComparison:
    """One step's samples, reference against faulted, filling its row and the first difference."""

    def __init__(self, row: StepRow, tol: Tolerance, async_mode: bool):
        self.row, self.tol, self.async_mode = row, tol, async_mode
        self.first: Difference | None = None
        self.versions_differ: Difference | None = None

    def diff(self, **kw: Any) -> None:
        if self.first is None:
            self.first = Difference(step=self.row.step, **kw)
        self.row.verdict = "DIFFERS"

    def samples(self, ref: list[TracedSample], run: list[TracedSample]) -> None:
        row = self.row
        ref_groups = list(dict.fromkeys(s.group_id for s in ref))
        run_groups = list(dict.fromkeys(s.group_id for s in run))
        row.groups, row.samples = len(ref_groups), len(ref)
        if ref_groups != run_groups:
            i = _first_mismatch(ref_groups, run_groups)
            self.diff(what=f"groups trained differ at group {i}", reference=ref_groups, faulted=run_groups)
            return
        if len(ref) != len(run):
            self.diff(what="sample count", reference=len(ref), faulted=len(run))
            return
        row.token_ids = row.masks = row.rewards = "exact"
        compared = 0
        for a, b in zip(ref, run):
            where = dict(group=a.group_id, sample=a.sibling, rollout=b.rollout_id)
            if (a.group_id, a.sibling) != (b.group_id, b.sibling):
                self.diff(what="sample order", reference=(a.group_id, a.sibling), faulted=(b.group_id, b.sibling),
                          group=a.group_id, sample=a.sibling)
                return
            if self.async_mode and [c.weight_version for c in a.calls] != [c.weight_version for c in b.calls]:
                if self.versions_differ is None:
                    self.versions_differ = Difference(
                        step=row.step, what="made with other weight versions (async: not comparable)",
                        reference=[c.weight_version for c in a.calls],
                        faulted=[c.weight_version for c in b.calls], **where)
                continue
            compared += 1
            self._sample(a, b, where)
        if self.async_mode:
            row.versions = f"{compared}/{len(ref)}"

    def _sample(self, a: TracedSample, b: TracedSample, where: dict[str, Any]) -> None:
        row = self.row
        if a.reward != b.reward:
            row.rewards = "differ"
            self.diff(what="reward", reference=a.reward, faulted=b.reward, **where)
        if (a.advantage is None) != (b.advantage is None) or (
                a.advantage is not None and not self.tol.close(b.advantage, a.advantage)):
            self.diff(what="advantage", reference=a.advantage, faulted=b.advantage, **where)
        if a.advantage is not None and b.advantage is not None:
            row.advantages_max = max(row.advantages_max, abs(a.advantage - b.advantage))
        ref_out, run_out = tool_outputs(a), tool_outputs(b)
        row.tool_effects += min(len(ref_out), len(run_out))
        if len(a.calls) != len(b.calls):
            self.diff(what="model calls in the rollout", reference=len(a.calls), faulted=len(b.calls), **where)
        for ci, (x, y) in enumerate(zip(a.calls, b.calls)):
            row.tokens += len(x.token_ids)
            t = _first_mismatch(x.token_ids, y.token_ids)
            if t is not None:
                row.token_ids = "differ"
                prompt = x.loss_mask.index(1) if 1 in x.loss_mask else len(x.token_ids)
                in_tool = ci > 0 and len(a.calls[ci - 1].token_ids) <= t < prompt
                what = "token id (in what the tools answered before this call)" if in_tool else "token id"
                self.diff(what=what, call=ci, token=t, reference=x.token_ids[t] if t < len(x.token_ids) else None,
                          faulted=y.token_ids[t] if t < len(y.token_ids) else None, **where)
            m = _first_mismatch(x.loss_mask, y.loss_mask)
            if m is not None:
                row.masks = "differ"
                self.diff(what="loss mask", call=ci, token=m, reference=x.loss_mask[m:m + 1],
                          faulted=y.loss_mask[m:m + 1], **where)
            if x.weight_version != y.weight_version:
                self.diff(what="weight version", call=ci, reference=x.weight_version, faulted=y.weight_version,
                          **where)
            self._logprobs(x.logprobs, y.logprobs, ci, x, where)

    def _logprobs(self, a: list[float], b: list[float], ci: int, call: Any, where: dict[str, Any]) -> None:
        if len(a) != len(b):
            self.diff(what="logprob count", call=ci, reference=len(a), faulted=len(b), **where)
            return
        prompt = len(call.token_ids) - len(a)
        for j, (x, y) in enumerate(zip(a, b)):
            self.row.logprobs_max = max(self.row.logprobs_max, abs(x - y))
            if not self.tol.close(y, x):
                self.diff(what="logprob", call=ci, token=prompt + j, reference=x, faulted=y, **where)


# ----------------------------------------------------------------------------- metrics, weights
def _compared_metric(key: str, value: Any) -> bool:
    if key in NOT_COMPARED or key.endswith("_s") or key.startswith(NOT_COMPARED_PREFIXES):
        return False
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def last_rows_by_step(metrics_file: Path) -> dict[int, dict[str, Any]]:
    rows: dict[int, dict[str, Any]] = {}
    for r in read_rows(metrics_file):
        if isinstance(r.get("step"), int) and r["step"] >= 1:
            rows[r["step"]] = r
    return rows


def compare_metrics(step: int, ref: dict[str, Any] | None, run: dict[str, Any] | None, tol: Tolerance,
                    row: StepRow) -> Difference | None:
    if ref is None or run is None:
        return Difference(step, "metrics row missing", reference=ref is not None, faulted=run is not None)
    first = None
    for key in sorted(k for k, v in ref.items() if _compared_metric(k, v)):
        a, b = float(ref[key]), run.get(key)
        if not isinstance(b, (int, float)):
            first = first or Difference(step, f"metric {key}", reference=a, faulted=b)
            continue
        b = float(b)
        if math.isnan(a) and math.isnan(b):
            continue
        row.metrics_max = max(row.metrics_max, abs(a - b))
        if not tol.close(b, a):
            first = first or Difference(step, f"metric {key}", reference=a, faulted=b)
    if ref.get("groups") != run.get("groups"):
        first = first or Difference(step, "metric groups", reference=ref.get("groups"), faulted=run.get("groups"))
    return first


def newest_step_dir(ckpt: Path) -> Path | None:
    steps = [(int(p.name.split("_", 1)[1]), p) for p in ckpt.glob("step_*")
             if p.is_dir() and p.name.split("_", 1)[1].isdigit()]
    return max(steps)[1] if steps else None


def compare_weights(ref_ckpt: Path, run_ckpt: Path) -> WeightsResult:
    """Every tensor of the newest trainer step of each run: equal, or the largest |difference| and where."""
    from safetensors.torch import load_file

    a_dir, b_dir = newest_step_dir(ref_ckpt), newest_step_dir(run_ckpt)
    if a_dir is None or b_dir is None or a_dir.name != b_dir.name:
        return WeightsResult(None, note=f"final trainer steps differ or are missing: reference {a_dir}, "
                                        f"under faults {b_dir}")
    a, b = {}, {}
    for d, into in ((a_dir, a), (b_dir, b)):
        for f in sorted(d.glob("*.safetensors")):
            into.update(load_file(str(f)))
    result = WeightsResult(b_dir.name, tensors=len(a))
    if set(a) != set(b):
        result.note = f"tensor names differ: {sorted(set(a) ^ set(b))[:5]}"
        return result
    for name in sorted(a):
        x, y = a[name], b[name]
        if x.shape != y.shape:
            result.note = f"{name}: shape {tuple(x.shape)} against {tuple(y.shape)}"
            return result
        d = float((x.double() - y.double()).abs().max()) if x.numel() else 0.0
        if d > result.max_abs:
            result.max_abs, result.worst = d, name
    return result


# ----------------------------------------------------------------------------- the report
def compare_runs(ref_logs: Path, ref_ckpt: Path, run_logs: Path, run_ckpt: Path, *, steps: int,
                 tol: Tolerance = Tolerance(), async_mode: bool = False, weights: bool = True) -> ParityReport:
    report = ParityReport(tolerance=tol)
    ref_traces, run_traces = read_step_traces(ref_logs), read_step_traces(run_logs)
    ref_metrics = last_rows_by_step(Path(ref_logs) / "metrics.jsonl")
    run_metrics = last_rows_by_step(Path(run_logs) / "metrics.jsonl")
    for step in range(1, steps + 1):
        row = StepRow(step)
        report.rows.append(row)
        if report.not_comparable_from is not None:
            row.verdict = "not comparable"
            continue
        a: StepTrace | None = ref_traces.get(step)
        b: StepTrace | None = run_traces.get(step)
        if a is None or b is None:
            row.verdict = "DIFFERS"
            missing = ref_logs if a is None else run_logs
            report.first = report.first or Difference(step, f"no trained-samples record in {missing}/trained",
                                                      reference=a is not None, faulted=b is not None)
            continue
        cmp = _StepComparison(row, tol, async_mode)
        cmp.samples(a.samples, b.samples)
        report.first = report.first or cmp.first
        if cmp.versions_differ is not None:
            report.not_comparable_from = step + 1
            report.notes.append(f"async: from step {step + 1} on the two runs' weights differ and nothing is "
                                f"comparable: at step {step}, {cmp.versions_differ.line()}")
            continue
        m = compare_metrics(step, ref_metrics.get(step), run_metrics.get(step), tol, row)
        if m is not None:
            row.verdict = "DIFFERS"
            report.first = report.first or m
    if weights and report.not_comparable_from is None:
        report.weights = compare_weights(Path(ref_ckpt), Path(run_ckpt))
        if report.weights.note is not None and report.first is None:
            report.first = Difference(steps, "final weights", reference=report.weights.note, faulted=None)
    elif weights:
        report.notes.append("async: final weights not compared (the runs trained on other weight versions)")
    report.notes.append("metrics not compared: timings (*_s), snapshot and recovery bookkeeping (snapshot*, "
                        "supervisor/*, gen_fleet/*), prefix continuation counts, validation (val_*; its rollouts "
                        "are not seeded by rollout)")
    return report


def _g(x: float) -> str:
    return "0" if x == 0 else f"{x:.1e}"


def render(report: ParityReport) -> str:
    """One markdown table, the final weights, notes, and the first difference."""
    tol = report.tolerance
    head = ["step", "groups", "samples", "tokens", "token ids", "masks", "rewards", "logprobs max |d|",
            "advantages max |d|", "metrics max |d|", "tool effects", "verdict"]
    async_cols = any(r.versions != "-" for r in report.rows)
    if async_cols:
        head.insert(-1, "same versions")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report.rows:
        cells = [str(r.step), str(r.groups), str(r.samples), str(r.tokens), r.token_ids, r.masks, r.rewards,
                 _g(r.logprobs_max), _g(r.advantages_max), _g(r.metrics_max), str(r.tool_effects), r.verdict]
        if async_cols:
            cells.insert(-1, r.versions)
        lines.append("| " + " | ".join(cells) + " |")
    w = report.weights
    if w is not None:
        if w.note is not None:
            lines.append(f"final weights: {w.note}")
        elif w.exact:
            lines.append(f"final weights ({w.step_dir}): exact, {w.tensors} tensors")
        else:
            lines.append(f"final weights ({w.step_dir}): DIFFER, largest |d| {w.max_abs:.3e} in {w.worst}")
    lines.append(f"tolerance: logprobs, advantages, metrics within rtol {tol.rtol:g} / atol {tol.atol:g}; "
                 "token ids, masks, rewards, groups, final weights exact")
    lines += [f"note: {n}" for n in report.notes]
    if report.first is not None:
        lines.append(f"first difference: {report.first.line()}")
    elif w is not None and not w.exact and w.note is None:
        lines.append(f"first difference: the final weights ({w.worst})")
    lines.append("PARITY: ok" if report.ok else "PARITY: FAILED")
    return "\n".join(lines)
