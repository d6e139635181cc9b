"""Shared pieces of the recovery benchmark: statistics, tables, real GRPO runs
measured from outside, and (for the rejected-alternative baseline only) a Gym
deployment with a closed-loop rollout client.

Every snapshot the benchmark reports as the product's is taken by the
controller itself: ``controller_run`` starts a GRPO run (``python -m
testkit.run_grpo``, the product's ``run_grpo`` main) through the shared run
harness (``testkit/run_harness.py``) with the scripted fake backend as policy
(its reply delay is ``policy.scripted_backend.delay_s``) and the recording
trainer, and reads what the run recorded
(``snapshots.jsonl``, ``metrics.jsonl``) plus timings that
``instrument/sitecustomize.py`` takes around the product's own functions.
The policy is the scripted backend (``gym_patches.fakes.scripted_backend``):
it answers with each row's demonstration after a fixed delay, so a measurement
isolates the control plane from generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import os
import shutil
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402

from gym_patches.checkpoint import coordination as co  # noqa: E402
from gym_patches.checkpoint.identity import EpisodeId  # noqa: E402
from gym_patches.launch import GymDeployment  # noqa: E402
from gym_patches.server_utils import ServerClient  # noqa: E402
from gym_patches.fakes.scripted_backend import ScriptedBackend, first_user_text  # noqa: E402
from testkit.run_harness import RunDirs, RunOutcome, read_jsonl, run_env, run_once, scripted_overrides  # noqa: E402

DATA = REPO / "examples" / "data"
TOKEN = "bench-recovery-control-token"
CONTROL = "/ng-control/v1/checkpoint"
Log = Callable[[str], None]


# -- output -------------------------------------------------------------------------------
def make_log(tag: str, sink: Log | None = None) -> Log:
    """Progress lines: ``[mm:ss] [tag] message`` (``sink`` defaults to stdout)."""
    started = time.monotonic()

    def log(message: str) -> None:
        elapsed = int(time.monotonic() - started)
        line = f"[{elapsed // 60:02d}:{elapsed % 60:02d}] [{tag}] {message}"
        if sink is not None:
            sink(line)
        else:
            print(line, flush=True)

    return log


def summary(values: Iterable[float]) -> dict[str, Any]:
    """Median with min, max and quartiles of a list of repeats."""
    vals = sorted(float(v) for v in values)
    if not vals:
        return {"n": 0, "median": None, "min": None, "max": None, "q1": None, "q3": None, "values": []}
    if len(vals) >= 2:
        q1, _, q3 = statistics.quantiles(vals, n=4, method="inclusive")
    else:
        q1 = q3 = vals[0]
    return {"n": len(vals), "median": statistics.median(vals), "min": vals[0], "max": vals[-1],
            "q1": q1, "q3": q3, "values": vals}


def fmt(s: dict[str, Any] | None, scale: float = 1.0, digits: int = 0, spread: bool = True) -> str:
    """``median (min–max)`` of a ``summary``; ``—`` when empty."""
    if not s or s.get("median") is None:
        return "—"

    def one(v: float) -> str:
        return f"{v * scale:,.{digits}f}"

    if not spread or s["n"] < 2:
        return one(s["median"])
    return f"{one(s['median'])} ({one(s['min'])}–{one(s['max'])})"


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def growth(sizes: Sequence[int], medians: Sequence[float]) -> dict[str, Any]:
    """How a cost grows with N: log-log slope, linear fit, and the ratio per 8x step.

    ``per_8x`` normalises each consecutive step to a factor of 8 in N
    (``(t2/t1) ** (log 8 / log(N2/N1))``), so 512 -> 2048 is comparable with 8 -> 64.
    ``no_worse_than_linear``: every step grew by at most its N ratio (+10 % noise allowance).
    """
    pts = [(n, t) for n, t in zip(sizes, medians) if t is not None and t > 0]
    out: dict[str, Any] = {"sizes": [p[0] for p in pts], "medians": [p[1] for p in pts]}
    if len(pts) < 2:
        return out
    xs = [math.log(n) for n, _ in pts]
    ys = [math.log(t) for _, t in pts]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    out["loglog_slope"] = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    ns = [n for n, _ in pts]
    ts = [t for _, t in pts]
    mn, mt = statistics.fmean(ns), statistics.fmean(ts)
    snn = sum((n - mn) ** 2 for n in ns)
    k = sum((n - mn) * (t - mt) for n, t in zip(ns, ts)) / snn
    out["linear_fit"] = {"intercept": mt - k * mn, "per_rollout": k}
    steps = []
    for (n1, t1), (n2, t2) in zip(pts, pts[1:]):
        ratio = t2 / t1
        steps.append({"from": n1, "to": n2, "ratio": ratio,
                      "per_8x": ratio ** (math.log(8) / math.log(n2 / n1)), "n_ratio": n2 / n1})
    out["steps"] = steps
    out["no_worse_than_linear"] = all(s["ratio"] <= s["n_ratio"] * 1.10 for s in steps)
    return out


# -- rows and plans -------------------------------------------------------------------------
def load_rows(name: str) -> list[dict[str, Any]]:
    with open(DATA / name) as f:
        return [json.loads(line) for line in f if line.strip()]


def tools_of(row: dict[str, Any]) -> tuple[str, ...]:
    return tuple(g["name"] for g in row.get("ground_truth") or [])


def user_of(row: dict[str, Any]) -> str:
    return first_user_text(row)


def unique_user_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows whose first user text no other row has (a backend hold then catches one row only)."""
    counts: dict[str, int] = {}
    for row in rows:
        counts[user_of(row)] = counts.get(user_of(row), 0) + 1
    return [r for r in rows if counts[user_of(r)] == 1]


def start_backend(rows: list[dict[str, Any]], delay_s: float = 0.0) -> ScriptedBackend:
    backend = ScriptedBackend().start()
    try:
        backend.plans_from_rows(rows)
        # fake tokens are bytes: a row's max_output_tokens would cut tool calls short
        backend.configure(delay_s=delay_s, respect_max_tokens=False)
    except BaseException:
        backend.stop()
        raise
    return backend


# -- Gym deployments -------------------------------------------------------------------------
def model_server() -> dict[str, Any]:
    return {"responses_api_models": {"vllm_model": {"request_timeout_s": 600}}}


def workplace_server(tool_delay_s: dict[str, float] | None = None) -> dict[str, Any]:
    return {"resources_servers": {"workplace_assistant": {"tool_delay_s": dict(tool_delay_s or {})}}}


def agent_server(impl: str, model: str, resources: str, max_steps: int = 6) -> dict[str, Any]:
    return {"responses_api_agents": {impl: {
        "max_steps": max_steps,
        "model_server": {"type": "responses_api_models", "name": model},
        "resources_server": {"type": "resources_servers", "name": resources},
    }}}


def gym_config(base_url: str, servers: dict[str, Any], lease_grace_s: float = 120.0) -> dict[str, Any]:
    return {
        "checkpoint": {"enabled": True, "control_auth_token": TOKEN, "lease_grace_seconds": lease_grace_s},
        "policy_base_url": base_url,
        **servers,
    }


@contextlib.contextmanager
def running(backend_rows: list[dict[str, Any]], servers: Callable[[str], dict[str, Any]], log_dir: Path,
            *, delay_s: float = 0.0, startup_timeout_s: float = 180.0) -> Iterator[tuple[ScriptedBackend, GymDeployment]]:
    """A scripted backend plus a Gym deployment on it; both are stopped on exit."""
    backend = start_backend(backend_rows, delay_s)
    try:
        dep = GymDeployment.start(gym_config(backend.base_url, servers(backend.base_url)),
                                  log_dir=log_dir, startup_timeout_s=startup_timeout_s)
        try:
            yield backend, dep
        finally:
            dep.stop()
    finally:
        backend.stop()


class SharedGym:
    """One deployment for the load measurements (stall, rejected alternative, overhead):
    the policy model, Workplace (saves sessions), ``simple`` (simple_agent, saves) and
    ``plain`` (plain_loop_agent, restart-only), all on one scripted backend."""

    MODEL, WORKPLACE, SIMPLE, PLAIN = "policy_model", "workplace", "simple", "plain"

    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.rows = load_rows("workplace_train.jsonl")
        self._stack = contextlib.ExitStack()
        self.backend: ScriptedBackend | None = None
        self.dep: GymDeployment | None = None

    def servers(self, _base_url: str) -> dict[str, Any]:
        return {
            self.MODEL: model_server(),
            self.WORKPLACE: workplace_server(),
            self.SIMPLE: agent_server("simple_agent", self.MODEL, self.WORKPLACE),
            self.PLAIN: agent_server("plain_loop_agent", self.MODEL, self.WORKPLACE),
        }

    def __enter__(self) -> "SharedGym":
        try:
            self.backend, self.dep = self._stack.enter_context(
                running(self.rows, self.servers, self.workdir / "shared-gym-logs"))
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def set_delay(self, delay_s: float) -> None:
        assert self.backend is not None
        self.backend.configure(delay_s=delay_s, respect_max_tokens=False)


@contextlib.contextmanager
def shared_gym(env: SharedGym | None, workdir: Path) -> Iterator[SharedGym]:
    """Use ``env`` if given (the caller owns it), else start one for this measurement."""
    if env is not None:
        yield env
        return
    with SharedGym(workdir) as own:
        yield own


class Control:
    """The async side of one deployment: discovered participants and a load client
    whose connector has no connection limit (aiohttp's default is 100)."""

    def __init__(self, dep: GymDeployment, client: ServerClient, parts: co.Participants,
                 http: aiohttp.ClientSession):
        self.dep, self.client, self.parts, self.http = dep, client, parts, http

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, dep: GymDeployment):
        client = await ServerClient.load_from_global_config(dep.head_url)
        http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None))
        try:
            parts = await co.discover(client, TOKEN, timeout_s=30)
            yield cls(dep, client, parts, http)
        finally:
            await http.close()
            await client.close()

    def only(self, names: Iterable[str]) -> co.Participants:
        wanted = set(names)
        return co.Participants([p for p in self.parts if p.name in wanted], self.parts.control)

    def without(self, names: Iterable[str]) -> co.Participants:
        dropped = set(names)
        return co.Participants([p for p in self.parts if p.name not in dropped], self.parts.control)

    async def status(self, server: str) -> dict[str, Any]:
        async with self.http.get(f"{self.dep.url(server)}{CONTROL}/status",
                                 headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
            body = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"status of {server}: HTTP {resp.status}: {body}")
            return body

    async def run(self, agent: str, row: dict[str, Any], key: str) -> tuple[int, Any]:
        async with self.http.post(self.dep.url(agent) + "/run", json={**row, "_ng_rollout_id": key}) as resp:
            try:
                body = await resp.json(content_type=None)
            except ValueError:
                body = await resp.text()
            return resp.status, body


# -- closed-loop rollout client -------------------------------------------------------------------
@dataclass
class Finished:
    key: str
    agent: str
    started: float  # time.monotonic()
    ended: float
    status: int
    code: str | None
    model_calls: int


class ClosedLoop:
    """``concurrency`` workers, each running rollouts back to back on the given
    (agent, row) plan. Like the controller, nothing is dispatched while
    ``dispatch_open`` is clear (a snapshot is being taken); a refused or retired
    rollout is started again as a new rollout id."""

    def __init__(self, ctl: Control, plan: Sequence[tuple[str, dict[str, Any]]], concurrency: int, prefix: str,
                 stagger_s: float = 0.0):
        self.ctl, self.plan, self.concurrency, self.prefix = ctl, list(plan), concurrency, prefix
        self.stagger_s = stagger_s  # spread the workers' first dispatch so completions do not come in waves
        self.dispatch_open = asyncio.Event()
        self.dispatch_open.set()
        self.inflight: dict[str, tuple[str, float]] = {}
        self.finished: list[Finished] = []
        self._tasks: list[asyncio.Task] = []
        self._seq = itertools.count()

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._worker(i), name=f"load:{self.prefix}:{i}")
                       for i in range(self.concurrency)]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def _worker(self, index: int) -> None:
        await asyncio.sleep(self.stagger_s * index / max(1, self.concurrency))
        while True:
            await self.dispatch_open.wait()
            n = next(self._seq)
            agent, row = self.plan[n % len(self.plan)]
            key = f"{self.prefix}-{index}-{n}"
            started = time.monotonic()
            self.inflight[key] = (agent, started)
            try:
                status, body = await self.ctl.run(agent, row, key)
            except aiohttp.ClientError as exc:
                status, body = 0, {"error": {"code": "client_error", "detail": repr(exc)}}
            finally:
                self.inflight.pop(key, None)
            code = None
            calls = 0
            if isinstance(body, dict):
                err = body.get("error")
                code = err.get("code") if isinstance(err, dict) else None
                calls = int(body.get("num_model_calls") or 0)
            self.finished.append(Finished(key, agent, started, time.monotonic(), status, code, calls))
            if status != 200:
                await asyncio.sleep(0.05)

    def scope(self, agents: Iterable[str] | None = None) -> list[EpisodeId]:
        wanted = None if agents is None else set(agents)
        return [EpisodeId.from_capture_key(k) for k, (a, _) in list(self.inflight.items())
                if wanted is None or a in wanted]

    def keys_on(self, agent: str) -> list[str]:
        return [k for k, (a, _) in list(self.inflight.items()) if a == agent]

    def completed_between(self, t0: float, t1: float) -> list[Finished]:
        return [f for f in self.finished if f.status == 200 and t0 <= f.ended < t1]

    def failed_between(self, t0: float, t1: float) -> list[Finished]:
        return [f for f in self.finished if f.status != 200 and t0 <= f.ended < t1]


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def fresh_dir(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


# -- real GRPO runs ----------------------------------------------------------------------------
INSTRUMENT = Path(__file__).resolve().parent / "instrument"
SCRIPTED = "policy.model_name=scripted-test-backend"
Variant = tuple[str, list[str]]  # (label, overrides laid over every controller run of a measurement)
DEFAULT_VARIANTS: list[Variant] = [("default", [])]


def inline_gym(config: dict[str, Any]) -> str:
    """An ``env.nemo_gym.config=...`` override: inline Gym YAML (JSON is YAML flow style)."""
    return "env.nemo_gym.config=" + json.dumps(config, separators=(", ", ": "))


def workplace_tool_delays(seconds: float) -> str:
    """Every Workplace tool takes ``seconds`` (the resources server's ``tool_delay_s``)."""
    tools = sorted({t for row in load_rows("workplace_train.jsonl") for t in tools_of(row)})
    return inline_gym({"workplace_assistant": {"resources_servers": {"workplace_assistant": {
        "tool_delay_s": {t: seconds for t in tools}}}}})


@dataclass
class ControllerRun:
    """What one ``run_grpo.py`` process did, read from outside."""

    dirs: RunDirs
    outcome: RunOutcome
    args: list[str]
    snapshots: list[dict[str, Any]]  # snapshots.jsonl
    metrics: list[dict[str, Any]]  # metrics.jsonl
    attempts: list[dict[str, Any]]  # one per snapshot attempt, with its timed phases (see ``timed_attempts``)
    tool_calls: list[dict[str, Any]]  # resources servers' tool calls, when ``tool_log``

    @property
    def command(self) -> str:
        return " ".join(["python", "examples/run_grpo.py", *self.args])


def controller_run(root: Path, *, config: str, overrides: list[str], delay_s: float, timeout_s: float = 300.0,
                   kill_when: Callable[[RunDirs, float], bool] | None = None, tool_log: bool = False,
                   extra_env: dict[str, str] | None = None, checkpoint_dir: Path | None = None) -> ControllerRun:
    """Run ``run_grpo.py --config <config>`` with the scripted backend (reply delay ``delay_s``) and the
    recording trainer until it exits or ``kill_when(dirs, elapsed_s)`` holds (then SIGKILL of its
    group); every process of it is gone when this returns."""
    root = fresh_dir(Path(root))
    dirs = RunDirs(root)
    ckpt = checkpoint_dir or dirs.ckpt
    args = ["--config", config, SCRIPTED, f"logger.log_dir={dirs.logs}", f"checkpointing.checkpoint_dir={ckpt}",
            "logger.progress_bar=false", "logger.plot=false", *scripted_overrides(delay_s), *overrides]
    timing = root / "snapshot-timing.jsonl"
    tools = root / "tool-calls.jsonl"
    env_extra = {"BENCH_SNAPSHOT_TIMING": str(timing), **({"BENCH_TOOL_LOG": str(tools)} if tool_log else {}),
                 **(extra_env or {})}
    env = run_env(pythonpath=[INSTRUMENT], extra=env_extra)
    outcome = run_once(args, env=env, stdout_path=root / "run.out", stderr_path=root / "run.out",
                       kill_when=None if kill_when is None else (lambda elapsed: kill_when(dirs, elapsed)),
                       timeout_s=timeout_s)
    return ControllerRun(dirs, outcome, args, dirs.records("snapshots.jsonl"), dirs.records("metrics.jsonl"),
                         timed_attempts(read_jsonl(timing)), read_jsonl(tools) if tool_log else [])


def timed_attempts(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Snapshot attempts (wall-clock windows) with the time of each timed call inside them:
    ``phases_s[name]`` sums ``gym:<operation>`` calls (``renew`` excluded) and ``publish``;
    ``first_start[name]`` is when the first such call began."""
    attempts = sorted((dict(e) for e in events if e.get("event") == "attempt"), key=lambda e: e["start"])
    calls = [e for e in events if e.get("event") not in ("attempt", "gym:renew")]
    for a in attempts:
        phases: dict[str, float] = {}
        first: dict[str, float] = {}
        for c in calls:
            if a["start"] <= c["start"] <= a["end"]:
                name = c["event"].removeprefix("gym:")
                phases[name] = phases.get(name, 0.0) + (c["end"] - c["start"])
                first[name] = min(first.get(name, c["start"]), c["start"])
        a["phases_s"], a["first_start"] = phases, first
    return attempts


def in_flight(snapshot: dict[str, Any]) -> int:
    """Turn-level rollouts a snapshot dealt with: saved + unsaved + not admitted."""
    return int(snapshot.get("saved", 0)) + int(snapshot.get("unsaved", 0)) + int(snapshot.get("not_admitted", 0))


def committed_count(dirs: RunDirs) -> int:
    return sum(1 for s in dirs.records("snapshots.jsonl") if s.get("committed"))


def generation_rate(run: ControllerRun, skip_steps: int = 0) -> dict[str, Any]:
    """Rollouts per minute of generation (samples over ``generation_s``) from ``metrics.jsonl``,
    ignoring the first ``skip_steps`` steps (warm-up)."""
    steps = [m for m in run.metrics if m.get("step", 0) > skip_steps]
    samples = sum(float(m.get("num_samples", 0)) for m in steps)
    seconds = sum(float(m.get("generation_s", 0)) for m in steps)
    return {"steps": len(steps), "samples": samples, "generation_s": seconds,
            "per_min": samples / seconds * 60 if seconds else None}


def machine_info() -> dict[str, Any]:
    import platform

    info: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                            "cpus": os.cpu_count()}
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/meminfo") as f:
            kb = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
            info["memory_gib"] = round(kb / 2**20, 1)
    return info
