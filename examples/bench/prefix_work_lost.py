"""Measurement 10: work lost per crash at ``target_level: prefix`` against ``turn``, and what a cut adds to the pause.

Real parts: the torch generation worker as a Ray actor (the embedded model's architecture, randomly
initialised: what it writes does not matter, how long it takes does), its HTTP routes, and Gym's
model participant (``PolicyModelParticipant.take_cut``, the step a prefix-level prepare adds).

Part 1, work lost. ``calls`` long calls (``max_tokens`` each, ``ignore_eos``) decode at once; every
``interval_s`` a snapshot's cut reads each call's tokens so far (``POST /v1/ng-cuts``) and keeps it as
the newest snapshot would. After a seeded number of snapshots (2-4), at a seeded moment inside the next
interval, the run "crashes": a last read gives the tokens each call had decoded then. The worker's decode
is metered (``testkit.decode_gate``: at most ``(max_tokens - 2) / 6`` steps an interval), so the calls are
still decoding at every snapshot and at the crash whatever the machine's speed. The same calls are then restored: each is sent again with its newest cut
(``ng_prefix``), and the reply must continue it (``prefix_continuation.token_count`` = the cut's, total =
``max_tokens``). Regenerated tokens per restored call, to get back to where the crash stopped it:
prefix = decoded at the crash - the cut's tokens; turn = decoded at the crash (the whole call restarts).
Goal: at prefix, at most the tokens one call decodes in one snapshot interval (measured: the rate of
each call times the longest gap between two cuts); at turn it is the whole call so far.

Part 2, the pause. ``pause_calls`` calls decode at once, held by the gate at ``pause_tokens`` tokens
and then let go with too few steps left to end; then, ``repeats`` times, the participant closes admission and takes its cut, timed: what the pause pays
(``take_cut``: note the calls in flight and start their pin, no wait on the backend) and, after
reopening, what persist pays while rollouts run (the pin lands, the pinned tokens are fetched: the
worker packing each call's tokens, the reply parsed). Goal: the cut adds at most 5 ms to the pause at
N = 512. (Awaiting the pin inside the pause measured 3.95-5.70 ms at N = 512 here, median 5.29: the
worker's event loop waits on the GIL its decode thread holds; hence the pin is not awaited there.)
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import Log, fmt, make_log, md_table, summary
from gym_patches.checkpoint.cuts import (
    CALL_ID_HEADER,
    CUT_FETCH_ROUTE,
    CUT_ROUTE,
    CutReply,
    CutRequest,
    FetchRequest,
    GenerationCut,
    PinReply,
)
from gym_patches.checkpoint.model import PolicyModelParticipant

NAME = "prefix_work_lost"
TITLE = "10. Work lost per crash, prefix against turn (regenerated tokens per restored call), and the cut's pause"
GOAL_PAUSE_MS = 5.0
MESSAGES = [{"role": "user", "content": "Write the long report of the quarterly planning sync."}]


def _model_dir(workdir: Path) -> Path:
    from nemo_rl.algorithms.grpo_config import TinyModelRecipe
    from nemo_rl.models.tiny_model import init_model, train_tokenizer

    path = workdir / "prefix-bench-model"
    if not (path / "config.json").exists():
        tok = train_tokenizer([MESSAGES[0]["content"], "tool_call report sync planning quarterly"] * 50, 300)
        model = init_model(TinyModelRecipe(), tok)
        path.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(path)
        model.save_pretrained(path)
    return path


class _Worker:
    """The torch generation worker as a Ray actor, owned by this object (started and stopped here)."""

    def __init__(self, workdir: Path, batch: int, max_seq_len: int):
        import ray

        from nemo_rl.algorithms.grpo_config import GenerationConfig, PolicyConfig
        from nemo_rl.models.generation.worker import model_files
        from testkit.decode_gate import GatedGenerationWorker

        repo = str(Path(__file__).resolve().parents[2])
        self.owns_ray = not ray.is_initialized()  # a caller's Ray (a test session's) is used, never shut down
        if self.owns_ray:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}})
        # a wide batch window: the calls an experiment sends at once decode in one batch (the torch worker
        # starts a new batch only when the running one ends)
        cfg = PolicyConfig(device="cpu", max_seq_len=max_seq_len,
                           generation=GenerationConfig(max_batch_size=batch, batch_window_ms=200.0, ignore_eos=True))
        directory = _model_dir(workdir)
        from nemo_rl.models.policy import load_policy

        weights = load_policy(str(directory), "float32", "cpu", max_seq_len).state_dict_cpu()
        self.ray = ray
        self.handle = GatedGenerationWorker.options(num_cpus=1).remote(cfg.model_dump(), model_files(directory), weights,
                                                                   1, 0, "bench")
        self.base_url = ray.get(self.handle.start.remote())

    async def call(self, method: str, *args: Any) -> Any:
        """One of the decode gate's methods (``testkit.decode_gate``), awaited."""
        return await getattr(self.handle, method).remote(*args)

    def close(self) -> None:
        try:
            self.ray.get(self.handle.open.remote())  # a held decode thread would keep stop() waiting
            self.ray.get(self.handle.stop.remote())
            self.ray.kill(self.handle)
        finally:
            if self.owns_ray:
                self.ray.shutdown()


async def _chat(session: aiohttp.ClientSession, base_url: str, call_id: str, max_tokens: int,
                cut: GenerationCut | None = None) -> dict:
    body: dict[str, Any] = {"model": "bench", "messages": MESSAGES, "max_tokens": max_tokens}
    if cut is not None:
        body["ng_prefix"] = cut.model_dump()
    async with session.post(base_url + "/chat/completions", json=body, headers={CALL_ID_HEADER: call_id}) as r:
        out = await r.json()
        if r.status != 200:
            raise RuntimeError(f"call {call_id}: {r.status} {out}")
        return out


class _Cuts:
    """The worker's cut routes as the model participant uses them (``CutSource``): pin, then fetch."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, owner: str = "bench"):
        self.session, self.base_url, self.owner = session, base_url, owner

    async def _post(self, route: str, body: str) -> bytes:
        async with self.session.post(self.base_url + route, data=body,
                                     headers={"Content-Type": "application/json"}) as r:
            if r.status != 200:
                raise RuntimeError(f"{route}: {r.status} {await r.text()}")
            return await r.read()

    async def pin(self, pin: str, call_ids: list[str]) -> dict[str, int]:
        body = CutRequest(owner=self.owner, pin=pin, call_ids=call_ids).model_dump_json()
        return PinReply.model_validate_json(await self._post(CUT_ROUTE, body)).counts

    async def fetch(self, pin: str) -> dict[str, GenerationCut]:
        body = FetchRequest(owner=self.owner, pin=pin).model_dump_json()
        return CutReply.model_validate_json(await self._post(CUT_FETCH_ROUTE, body)).cuts


async def _cut(session: aiohttp.ClientSession, base_url: str, call_ids: list[str]) -> dict[str, GenerationCut]:
    """A snapshot's whole cut: the pin (in the pause) and its fetch (after)."""
    cuts = _Cuts(session, base_url)
    await cuts.pin("snap", call_ids)
    return await cuts.fetch("snap")


async def _held(worker: "_Worker", session: aiohttp.ClientSession, ids: list[str]) -> dict[str, int] | None:
    """Wait until the decode thread waits for credit; the calls' token counts then, or None when not every
    call is in the held batch (the worker batched them apart: a call still queued is in no pin)."""
    if not await worker.call("wait_held"):
        raise RuntimeError("the generation worker never came to a step boundary (no batch decoding)")
    counts = await _Cuts(session, worker.base_url, owner="probe").pin("p", ids)
    return counts if len(counts) == len(ids) else None


async def _crash_once(worker: "_Worker", calls: int, max_tokens: int, interval_s: float, rng: random.Random,
                      log: Log) -> dict[str, Any]:
    """One crash. The decode is metered (``testkit.decode_gate``): each interval lets every call decode at most
    ``step`` tokens, so the calls are still decoding at every snapshot and at the crash on any machine;
    on a slow machine an interval ends by the clock with fewer tokens decoded (never none)."""
    snapshots = rng.randint(2, 4)  # committed snapshots before the crash
    step = (max_tokens - 2) // (4 + 2)  # the most intervals: 4 snapshots and the crash's
    base_url = worker.base_url
    ids = [f"crash{rng.randrange(1 << 30):x}-{i}.c" for i in range(calls)]
    async with aiohttp.ClientSession() as s:
        crash_read = _Cuts(s, base_url, owner="crash")
        await worker.call("close_gate")
        started = time.monotonic()
        live = [asyncio.ensure_future(_chat(s, base_url, cid, max_tokens)) for cid in ids]
        if await _held(worker, s, ids) is None:
            raise RuntimeError(f"the worker did not batch the {calls} calls together (batch_window_ms too short?)")

        async def interval(budget: int, seconds: float) -> None:
            """Let the calls decode for ``seconds`` and at most ``budget`` steps (at least one)."""
            await worker.call("grant", budget)
            t0 = time.monotonic()
            while time.monotonic() - t0 < seconds or await worker.call("credit") >= budget:
                await asyncio.sleep(0.01)

        pins: list[dict[str, int]] = []  # each snapshot's pinned counts, oldest first (snapshot k: owner snap-k)
        for k in range(1, snapshots + 1):
            await interval(step, interval_s)
            pins.append(await _Cuts(s, base_url, owner=f"snap-{k}").pin("s", ids))
            await worker.call("close_gate")  # what the last interval did not decode is not carried over
        # the crash: somewhere inside the next interval
        await interval(rng.randrange(1, step + 1), rng.uniform(0.0, interval_s))
        at_crash = await crash_read.pin("crash", ids)  # what each call had decoded when the crash hit
        crashed_s = time.monotonic() - started
        await worker.call("open")  # the crashed run's calls run to their end: their replies are lost with it
        newest = len(pins)  # the newest snapshot: its cuts, as its persist wrote them
        saved = await _Cuts(s, base_url, owner=f"snap-{newest}").fetch("s")
        if set(saved) != set(pins[-1]) or len(saved) != calls:
            raise RuntimeError(f"snapshot {newest} pinned {len(pins[-1])} calls, its fetch gave {len(saved)}")
        await asyncio.gather(*live)
        # restore: each call again, continuing from the newest snapshot's cut
        restored = await asyncio.gather(*(_chat(s, base_url, cid.replace("crash", "restored"), max_tokens, saved[cid])
                                          for cid in ids))
    # the tokens one call decodes in one snapshot interval: the largest step between two snapshots' pins
    interval_tokens = max(b[c] - a.get(c, 0) for a, b in zip(pins, pins[1:]) for c in b)
    lost_prefix, lost_turn, problems = [], [], []
    for cid, out in zip(ids, restored):
        truth = at_crash.get(cid, max_tokens)
        cont = out.get("prefix_continuation") or {}
        if cont.get("token_count") != saved[cid].token_count or len(out["generation_token_ids"]) != max_tokens:
            problems.append(f"{cid}: continued {cont} to {len(out['generation_token_ids'])} tokens")
        if out["generation_token_ids"][:saved[cid].token_count] != saved[cid].unpack()[0]:
            problems.append(f"{cid}: the restored reply does not start with the saved prefix")
        lost_prefix.append(truth - saved[cid].token_count)
        lost_turn.append(truth)
    log(f"crash at {crashed_s:.1f}s: {len(pins)} snapshots before it; per restored call regenerated "
        f"{statistics.median(lost_prefix):.0f} (prefix) vs {statistics.median(lost_turn):.0f} (turn) tokens; "
        f"one interval = {interval_tokens} tokens")
    return {"crash_s": crashed_s, "cuts": len(pins), "lost_prefix": lost_prefix, "lost_turn": lost_turn,
            "decode_tok_per_s_per_call": interval_tokens / interval_s, "interval_tokens": interval_tokens,
            "problems": problems}


PAUSE_ROUNDS = 3  # calls that end before all reach the cut's size (split into two batches) start a new round


async def _pause(worker: "_Worker", calls: int, max_tokens: int, at_least: int, repeats: int,
                 log: Log) -> dict[str, Any]:
    base_url = worker.base_url
    model = PolicyModelParticipant()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        model.cut_source = _Cuts(s, base_url, owner="pause")

        async def tracked(cid: str) -> None:  # one episode's call, generating in the backend
            async with model.call(cid.removesuffix(".c")) as ticket:
                ticket.call_id = cid
                await model.run(ticket, _chat(s, base_url, cid, max_tokens))

        for round_ in range(PAUSE_ROUNDS):
            ids = [f"pause{round_}-{i}.c" for i in range(calls)]
            await worker.call("close_gate")
            await worker.call("grant", at_least)  # every call held at the cut's size, on any machine
            live = [asyncio.ensure_future(tracked(cid)) for cid in ids]
            if await _held(worker, s, ids) is not None:
                break
            await worker.call("open")  # batched apart: let this round end, start another
            await asyncio.gather(*live, return_exceptions=True)
            log(f"N={calls}: the worker batched the calls apart; round {round_ + 2}")
        else:
            raise RuntimeError(f"{calls} calls were never decoded in one batch in {PAUSE_ROUNDS} rounds")
        # the calls decode while the cuts are taken (the pause pays for the decode thread's GIL), and cannot
        # end before the last one: at most max_tokens - 2 steps in all
        await worker.call("grant", max(0, max_tokens - 3 - at_least))
        times, tokens, fetches = [], [], []
        for _ in range(repeats):
            await model.close_admission("block")
            t = time.perf_counter()
            summary_ = await model.take_cut()  # what the pause pays: note the calls, start the pin
            times.append(time.perf_counter() - t)
            if summary_.error or summary_.in_flight != calls:
                raise RuntimeError(f"the cut noted {summary_.in_flight} of {calls}: {summary_.error}")
            complete = model.capture_completion()
            await model.open_admission()
            t = time.perf_counter()
            late, failed, why = await complete()  # after resume: the pin lands, the tokens are fetched
            fetches.append(time.perf_counter() - t)
            if len(late) != calls or failed:
                raise RuntimeError(f"the cut completed {len(late)} of {calls}: {why}")
            tokens.append(sum(fields["cut_tokens"] for fields in late.values()))
        await worker.call("open")
        await asyncio.gather(*live)  # every call to its end before the session closes
    log(f"N={calls}: the cut adds {statistics.median(times) * 1e3:.3f} ms to the pause; its {statistics.median(tokens):.0f} "
        f"tokens are pinned and fetched after resume in {statistics.median(fetches) * 1e3:.1f} ms (medians)")
    return {"calls": calls, "cut_ms": summary([t * 1e3 for t in times]), "tokens": summary(tokens),
            "fetch_ms": summary([t * 1e3 for t in fetches])}


def measure(*, workdir: Path, log: Log | None = None, calls: int = 8, max_tokens: int = 400, interval_s: float = 1.0,
            crashes: int = 3, seed: int = 0, pause_calls: tuple[int, ...] = (64, 512), pause_tokens: int = 200,
            pause_max_tokens: int = 320, repeats: int = 5) -> dict[str, Any]:
    log = log or make_log(NAME)
    rng = random.Random(seed)
    worker = _Worker(workdir, batch=max(calls, *pause_calls), max_seq_len=max_tokens + pause_max_tokens + 64)
    try:
        crashes_out = []
        for i in range(crashes):
            log(f"crash {i + 1}/{crashes}: {calls} calls of {max_tokens} tokens, a cut every {interval_s:g} s")
            crashes_out.append(asyncio.run(_crash_once(worker, calls, max_tokens, interval_s, rng, log)))
        pauses = []
        for n in pause_calls:
            log(f"pause: {n} calls decoding, each cut at >= {pause_tokens} tokens, {repeats} times")
            pauses.append(asyncio.run(_pause(worker, n, pause_max_tokens, pause_tokens, repeats, log)))
    finally:
        worker.close()
    prefix = [x for c in crashes_out for x in c["lost_prefix"]]
    turn = [x for c in crashes_out for x in c["lost_turn"]]
    # per crash: what its calls lost against what one of its calls decodes in one of its intervals
    worst = max(crashes_out, key=lambda c: max(c["lost_prefix"]) - c["interval_tokens"])
    at_512 = next((p for p in pauses if p["calls"] == 512), None)
    goal = {
        "prefix_lost_max": max(worst["lost_prefix"]), "interval_tokens_min": worst["interval_tokens"],
        "prefix_within_one_interval": all(max(c["lost_prefix"]) <= c["interval_tokens"] for c in crashes_out)
        and not any(c["problems"] for c in crashes_out),
        "turn_lost_median": statistics.median(turn), "prefix_lost_median": statistics.median(prefix),
        "cut_ms_at_512": None if at_512 is None else at_512["cut_ms"]["median"],
        "pause_met": None if at_512 is None else at_512["cut_ms"]["max"] <= GOAL_PAUSE_MS,
        "fetch_ms_at_512": None if at_512 is None else at_512["fetch_ms"]["median"],
        "problems": [p for c in crashes_out for p in c["problems"]],
    }
    return {"name": NAME, "title": TITLE,
            "config": {"calls": calls, "max_tokens": max_tokens, "interval_s": interval_s, "crashes": crashes,
                       "seed": seed, "pause_tokens": pause_tokens},
            "crashes": crashes_out, "pauses": pauses,
            "lost": {"prefix": summary(prefix), "turn": summary(turn)}, "goal": goal}


def table(res: dict[str, Any]) -> str:
    cfg = res["config"]
    rows = [[f"{i + 1}", f"{c['crash_s']:.1f} s", str(c["cuts"]), f"{c['decode_tok_per_s_per_call']:.0f}",
             f"{c['interval_tokens']:.0f}", fmt(summary(c["lost_prefix"])), fmt(summary(c["lost_turn"])),
             "none" if not c["problems"] else f"{len(c['problems'])}"]
            for i, c in enumerate(res["crashes"])]
    part1 = md_table(["crash", "at", "cuts before it", "tokens/s per call", "tokens in one interval",
                      "regenerated per call, prefix", "regenerated per call, turn", "continuation problems"], rows)
    part2 = md_table(["calls in flight", "tokens cut", "ms added to the pause", "pin + fetch ms (rollouts running)"],
                     [[str(p["calls"]), fmt(p["tokens"]), fmt(p["cut_ms"], 1, 3), fmt(p["fetch_ms"], 1, 1)]
                      for p in res["pauses"]])
    return (f"{cfg['calls']} calls of {cfg['max_tokens']} tokens, a snapshot every {cfg['interval_s']:g} s, "
            f"{cfg['crashes']} crashes (seed {cfg['seed']}); medians (min–max):\n\n{part1}\n\n{part2}")


def verdict(g: dict[str, Any]) -> str:
    def yes(v: bool | None) -> str:
        return "not measured" if v is None else ("met" if v else "NOT met")

    pause = "—" if g["cut_ms_at_512"] is None else f"{g['cut_ms_at_512']:.2f} ms median"
    return (f"prefix regenerates at most one interval's tokens per restored call: {yes(g['prefix_within_one_interval'])} "
            f"(closest crash: {g['prefix_lost_max']:.0f} against its interval's {g['interval_tokens_min']:.0f}; median {g['prefix_lost_median']:.0f} "
            f"against {g['turn_lost_median']:.0f} at turn); the cut adds at most {GOAL_PAUSE_MS:g} ms to the pause at "
            f"N=512: {yes(g['pause_met'])} ({pause})")
