"""Micro-benchmark: the Gym side of a staged snapshot's prepare, at N sessions per agent server.

    python examples/bench/prepare_micro.py 512 2048 8192            # table, median of --repeats
    python examples/bench/prepare_micro.py 8192 --repeats 3 --profile  # plus cProfile of the prepares

One process, one asyncio loop, no HTTP (the control plane's HTTP cost is separate). A real
``AgentSessionParticipant`` hosts N ``/run``s of the real agent loop (``run_episode``) on rows of
``examples/data/workplace_train.jsonl``; their model calls pass the real ``PolicyModelParticipant``'s
gate, their seeds, tool calls and verifies the real ``ResourcesParticipant`` (``exported``, the
Workplace server's hooks and ``OfficeWorld``). Only generation is stood in: the bench hands out each
reply (a Workplace tool call with token info, or a final answer), so it decides which sessions move.
After one turn each, a capture holds about 8.0 KB per rollout from the agent, 1.2 KB from Workplace
and 0.1 KB from the model (a real 8192-rollout run staged 6.8, 1.2 and 0.02 KB).

At every prepare the sessions are where a busy replica has them: most waiting on the model, some in a
tool call (it returns once admission has closed, as a real one would), a few new ``/run``s seeding.
Each participant then does what the control plane does for a ``capture`` prepare
(``control/plane.py``): ``close_admission``; ``is_ready`` and ``wait_changed`` until ready;
``readiness`` once; ``take_capture``.

- **first**: the first prepare of the run (nothing serialised yet);
- **steady**: after reopening, ``--moved`` of the sessions moved before the next prepare: one model
  turn, or into a tool call still running at the prepare, or their episode ended and a new ``/run``
  took their place (seeding at the prepare). The state between two snapshots.

Times are thread CPU ms (``time.thread_time``, GC frozen during each prepare): per participant its
``close_admission``, its readiness checks (the ``is_ready`` polls and the one ``readiness``: count
and total) and its capture (``take_capture``, and
in brackets its own ``capture_records`` in it, timed again after the window), and the whole window
from the first close to the last capture, which also holds the loop's work for the sessions that come
to rest meanwhile (the three servers' work, run here in one thread). ``reopen all``: the three
``open_admission`` calls of the resume that follows (the loop's work for the released sessions is not in it).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import copy
import gc
import io as _io
import itertools
import json
import pstats
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from gym_patches.checkpoint.agent import AgentSessionParticipant  # noqa: E402
from gym_patches.checkpoint.control.staging import take_capture  # noqa: E402
from gym_patches.checkpoint.identity import EpisodeId  # noqa: E402
from gym_patches.checkpoint.model import PolicyModelParticipant  # noqa: E402
from gym_patches.checkpoint.participant import CheckpointParticipant  # noqa: E402
from gym_patches.checkpoint.resources import ResourcesParticipant, SessionStateHooks  # noqa: E402
from gym_patches.resources_servers.workplace import seed_from_row  # noqa: E402
from gym_patches.resources_servers.workplace_assistant.app import WorkplaceAssistantServer  # noqa: E402
from gym_patches.responses_api_agents.loop import run_episode  # noqa: E402
from gym_patches.wire_models import SESSION_COOKIE  # noqa: E402

ROWS = REPO / "examples" / "data" / "workplace_train.jsonl"
MAX_STEPS = 10_000  # episodes end only when the bench hands out a final answer
PROMPT_TOKENS = 120  # token info the model server attaches to a reply's last item
GENERATION_TOKENS = 24


class WorkplaceHooks(SessionStateHooks):
    """The Workplace server's own export/restore, without its HTTP server."""

    export_session_state = WorkplaceAssistantServer.export_session_state
    restore_session_state = WorkplaceAssistantServer.restore_session_state

    async def close_state(self, state: Any) -> None:
        return None


def tool_reply(turn: int, person: str) -> dict[str, Any]:
    """A reply asking for one read-only Workplace tool, token info on its last item."""
    item = {"type": "function_call", "call_id": f"call-{turn}", "name": "directory_find_email",
            "arguments": json.dumps({"name": person}),
            "prompt_token_ids": list(range(1000, 1000 + PROMPT_TOKENS)),
            "generation_token_ids": list(range(7, 7 + GENERATION_TOKENS)),
            "generation_log_probs": [-0.25] * GENERATION_TOKENS, "weight_version": 0}
    return {"id": f"resp-{turn}", "object": "response", "model": "bench", "output": [item],
            "usage": {"input_tokens": PROMPT_TOKENS, "output_tokens": GENERATION_TOKENS,
                      "total_tokens": PROMPT_TOKENS + GENERATION_TOKENS}}


def final_reply(turn: int) -> dict[str, Any]:
    item = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done."}],
            "prompt_token_ids": [1], "generation_token_ids": [2], "generation_log_probs": [-0.1],
            "weight_version": 0}
    return {"id": f"resp-{turn}", "object": "response", "model": "bench", "output": [item],
            "usage": {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2}}


class Replica:
    """One agent, model and resources server in one loop, with the generation the bench controls."""

    def __init__(self) -> None:
        self.agent = AgentSessionParticipant()
        self.model = PolicyModelParticipant()
        self.resources = ResourcesParticipant("exported", WorkplaceHooks(), instance="workplace")
        self.rows = [json.loads(line) for line in ROWS.read_text().splitlines() if line.strip()]
        self.generating: dict[str, asyncio.Future[dict[str, Any]]] = {}  # capture key -> its reply to come
        self.tool_gates: dict[str, asyncio.Future[None]] = {}  # session id -> a tool call held until released
        self.seed_gates: dict[str, asyncio.Future[None]] = {}  # capture key -> a seed held until released
        self.in_tool: set[str] = set()
        self.seeding: set[str] = set()
        self.runs: dict[str, asyncio.Task[Any]] = {}
        self._ids = itertools.count()

    @property
    def parts(self) -> dict[str, CheckpointParticipant]:
        return {"agent": self.agent, "workplace": self.resources, "model": self.model}

    # -- the LoopIO the agent loop calls ----------------------------------------
    async def seed(self, row: dict[str, Any], capture_key: str) -> dict[str, str]:
        episode = EpisodeId.from_capture_key(capture_key)
        async with self.resources.seeding(episode):
            gate = self.seed_gates.get(capture_key)
            if gate is not None:
                self.seeding.add(capture_key)
                await gate
                self.seeding.discard(capture_key)
                del self.seed_gates[capture_key]
            world = seed_from_row(row)
        session_id = f"s-{capture_key}"
        self.resources.add_session(session_id, episode, world)
        return {SESSION_COOKIE: session_id}

    async def call_model(self, capture_key: str, body: dict[str, Any]) -> dict[str, Any]:
        async with self.model.call(capture_key) as ticket:
            future = asyncio.get_running_loop().create_future()
            self.generating[capture_key] = future
            reply = await self.model.run(ticket, future)
            await self.model.release_response(ticket)
            self.model.delivered(ticket)
            return reply

    async def call_tool(self, name: str, arguments: dict[str, Any], cookies: dict[str, str]) -> str:
        session_id = cookies[SESSION_COOKIE]
        async with self.resources.session_call(session_id) as session:
            gate = self.tool_gates.get(session_id)
            if gate is not None:
                self.in_tool.add(session_id)
                await gate
                self.in_tool.discard(session_id)
                del self.tool_gates[session_id]
            return session.state.call_tool(name, arguments)

    async def verify(self, row: dict[str, Any], output: list[Any], cookies: dict[str, str]) -> float:
        async with self.resources.session_call(cookies[SESSION_COOKIE]) as session:
            pass
        await self.resources.end_session(session)
        return 1.0

    # -- driving sessions ---------------------------------------------------------
    def start_run(self, *, seed_held: bool = False) -> str:
        n = next(self._ids)
        key = f"bench-{n:06d}"
        row = copy.deepcopy(self.rows[n % len(self.rows)])
        if seed_held:
            self.seed_gates[key] = asyncio.get_running_loop().create_future()

        async def runner(activation=None, restored_from=None, restored_state=None):
            return await run_episode(self, row, capture_key=key, max_steps=MAX_STEPS, activation=activation,
                                     restored_from=restored_from, restored_state=restored_state)

        task = asyncio.create_task(self.agent.run_session(EpisodeId.from_capture_key(key), runner))
        self.runs[key] = task
        task.add_done_callback(lambda _t, k=key: self.runs.pop(k, None))
        return key

    def reply(self, key: str, *, final: bool = False, tool_held: bool = False) -> None:
        """Hand out the reply ``key`` waits for (a tool call, or the final answer)."""
        future = self.generating.pop(key)
        turn = len(self.agent._sessions[key].state.new_outputs) if key in self.agent._sessions else 0
        if tool_held:
            self.tool_gates[f"s-{key}"] = asyncio.get_running_loop().create_future()
        people = self.agent._sessions[key].state.seed_row["seed"]["people"]
        future.set_result(final_reply(turn) if final else tool_reply(turn, people[turn % len(people)]["name"]))

    async def release_held(self) -> None:
        """The tools and seeds in flight return while admission is closed, one at a time (each on a
        loop pass of its own, as calls that finish at different moments do)."""
        for gate in [*self.tool_gates.values(), *self.seed_gates.values()]:
            if not gate.done():
                gate.set_result(None)
            await asyncio.sleep(0)

    def seeds_at_once(self, new_runs: int) -> int:
        """How many of ``new_runs`` seed at once: the agent's start gate lets ``limit`` start, the rest wait."""
        return min(new_runs, self.agent.start_gate.limit)

    async def settle(self, waiting: int, in_tool: int, seeding: int, timeout: float = 120.0) -> None:
        """Until ``waiting`` sessions wait on the model and the held tools and seeds have started."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while not (len(self.generating) == waiting and len(self.in_tool) == in_tool
                   and len(self.seeding) == seeding):
            if loop.time() > end:
                raise RuntimeError(f"replica did not settle: {len(self.generating)}/{waiting} waiting on the model, "
                                   f"{len(self.in_tool)}/{in_tool} in a tool, {len(self.seeding)}/{seeding} seeding")
            await asyncio.sleep(0.005)


class Timed:
    """Thread CPU spent in one participant's checkpoint calls during one prepare."""

    def __init__(self) -> None:
        self.close = self.readiness = self.capture = self.own_capture = 0.0
        self.readiness_calls = 0


async def prepare(replica: Replica, checkpoint_id: str) -> tuple[float, dict[str, Timed], dict[str, int]]:
    """A ``capture`` prepare on every participant, as the control plane runs it; CPU ms and keys captured."""
    parts = replica.parts
    timed = {name: Timed() for name in parts}

    def readiness(name: str, check: str = "readiness"):
        p, t = parts[name], timed[name]
        start = time.thread_time()
        report = getattr(p, check)()
        t.readiness += time.thread_time() - start
        t.readiness_calls += 1
        return report

    async def wait_ready(name: str) -> None:
        while not readiness(name, "is_ready"):  # the plane polls the cheap check, then builds the report once
            await parts[name].wait_changed(1.0)

    start = time.thread_time()
    for name, p in parts.items():
        t0 = time.thread_time()
        await p.close_admission("block")
        timed[name].close = time.thread_time() - t0
    await asyncio.gather(replica.release_held(), *(wait_ready(name) for name in parts))
    captured: dict[str, int] = {}
    for name, p in parts.items():
        report = readiness(name)
        assert report.ready, f"{name} stopped being ready: {report}"
        t0 = time.thread_time()
        staged = await take_capture(p, name, checkpoint_id, report.unsaved)
        timed[name].capture = time.thread_time() - t0
        captured[name] = len(staged.keys)
    window = time.thread_time() - start
    for name, p in parts.items():  # outside the window: the participant's share of its capture
        t0 = time.thread_time()
        await p.capture_records()
        timed[name].own_capture = time.thread_time() - t0
    return window, timed, captured


async def reopen(replica: Replica) -> None:
    for p in replica.parts.values():
        await p.open_admission()


def move(replica: Replica, rng: random.Random, fraction: float, in_tool: float, ended: float) -> tuple[int, int]:
    """Let ``fraction`` of the sessions move: some into a tool call left running, some to the end of their
    episode (a new ``/run`` seeding in its place), the rest one whole turn. Returns (in tool, seeding)."""
    waiting = sorted(replica.generating)
    n = len(waiting)
    chosen = rng.sample(waiting, max(1, round(fraction * n)))
    k_tool, k_end = round(in_tool * n), round(ended * n)
    for key in chosen[:k_tool]:
        replica.reply(key, tool_held=True)
    for key in chosen[k_tool:k_tool + k_end]:
        replica.reply(key, final=True)
        replica.start_run(seed_held=True)
    for key in chosen[k_tool + k_end:]:
        replica.reply(key)
    return k_tool, k_end


def ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


async def measure(n: int, repeats: int, fraction: float, in_tool: float, ended: float,
                  profiler: cProfile.Profile | None, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    replica = Replica()
    for _ in range(n):
        replica.start_run()
    await replica.settle(n, 0, 0)
    for key in sorted(replica.generating):  # one turn each, so a state is as large as a running one's
        replica.reply(key)
    await replica.settle(n, 0, 0)
    k_tool, k_end = move(replica, rng, fraction, in_tool, ended)
    await replica.settle(n - k_tool - k_end, k_tool, replica.seeds_at_once(k_end))
    rounds: list[dict[str, Any]] = []
    for r in range(repeats + 1):
        gc.collect()
        gc.freeze()
        if profiler is not None and r > 0:
            profiler.enable()
        total, timed, captured = await prepare(replica, f"ckpt-{r}")
        if profiler is not None:
            profiler.disable()
        # the agent leaves out a /run seeding or waiting to start at the prepare (it restarts from its
        # prompt, design §4.4)
        assert captured["agent"] == n - k_end, f"agent captured {captured['agent']} of {n} sessions ({k_end} new)"
        # Workplace holds a key per session and per seed in flight; one still waiting to start has neither
        unstarted = k_end - replica.seeds_at_once(k_end)
        assert captured["workplace"] == n - unstarted, (
            f"workplace captured {captured['workplace']} of {n} sessions ({unstarted} waiting to start)")
        t0 = time.thread_time()
        await reopen(replica)
        rounds.append({"total": total, "timed": timed, "captured": captured, "reopen": time.thread_time() - t0})
        gc.unfreeze()
        await replica.settle(n, 0, 0)  # held tools finish their turn, new runs seed and call the model
        if r < repeats:
            k_tool, k_end = move(replica, rng, fraction, in_tool, ended)
            await replica.settle(n - k_tool - k_end, k_tool, replica.seeds_at_once(k_end))
    for key in sorted(replica.generating):  # tear down: every run ends
        replica.reply(key, final=True)
    await asyncio.gather(*replica.runs.values(), return_exceptions=True)
    return {"n": n, "first": rounds[0], "steady": rounds[1:]}


def row_of(n: int, label: str, rounds: list[dict[str, Any]]) -> list[Any]:
    """One table row: medians over ``rounds`` of each participant's times."""

    def med(name: str, get: Callable[[Timed], float]) -> float:
        return statistics.median(get(r["timed"][name]) for r in rounds)

    def part(name: str) -> list[Any]:
        return [ms(med(name, lambda t: t.close)),
                f"{ms(med(name, lambda t: t.readiness))} ({med(name, lambda t: t.readiness_calls):.0f})",
                f"{ms(med(name, lambda t: t.capture))} ({ms(med(name, lambda t: t.own_capture))})"]

    model = ms(med("model", lambda t: t.close + t.readiness + t.capture))
    window = ms(statistics.median(r["total"] for r in rounds))
    reopened = ms(statistics.median(r["reopen"] for r in rounds))
    return [n, label, len(rounds), *part("agent"), *part("workplace"), model, window, reopened]


HEADER = ["N", "prepare", "runs", "agent close", "agent readiness (calls)", "agent capture (own)",
          "workplace close", "workplace readiness (calls)", "workplace capture (own)", "model all", "window",
          "reopen all"]


def md_table(rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "|".join("---" for _ in HEADER) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sizes", nargs="*", type=int, default=[512, 2048, 8192])
    parser.add_argument("--repeats", type=int, default=5, help="steady prepares per size (median)")
    parser.add_argument("--moved", type=float, default=0.10, help="share of sessions that move between prepares")
    parser.add_argument("--in-tool", type=float, default=0.05, help="share of sessions in a tool call at a prepare")
    parser.add_argument("--ended", type=float, default=0.01, help="share whose episode ends (new /run seeding)")
    parser.add_argument("--profile", action="store_true", help="cProfile the steady prepares of the last size")
    args = parser.parse_args(argv)
    if args.in_tool + args.ended > args.moved:
        parser.error("--in-tool plus --ended must not exceed --moved")
    rows: list[list[Any]] = []
    profiler = None
    for i, n in enumerate(args.sizes):
        started = time.monotonic()
        if args.profile and i == len(args.sizes) - 1:
            profiler = cProfile.Profile()
        result = asyncio.run(measure(n, args.repeats, args.moved, args.in_tool, args.ended, profiler))
        rows.append(row_of(n, "first", [result["first"]]))
        rows.append(row_of(n, "steady", result["steady"]))
        print(f"N={n}: done in {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)
    print("thread CPU ms, median; readiness: total over its calls (median number of calls); capture: "
          "take_capture (the participant's capture_records in it)")
    print(md_table(rows))
    if profiler is not None:
        out = _io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(30)
        print(out.getvalue())


if __name__ == "__main__":
    main()
