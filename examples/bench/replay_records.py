"""Micro-benchmark: what recording calls for replay (``record_calls``) costs the model server.

    python examples/bench/replay_records.py 512 --turns 6            # table: record_calls off against on
    python examples/bench/replay_records.py 512 2048 --moved 0.1     # a tenth of the episodes move per interval

One process, one asyncio loop, no HTTP. A real ``PolicyModelParticipant`` serves N episodes through its gate
the way the model server drives it (``plan_call``, ``release_response``, ``delivered`` with the reply's
bytes); only the backend is stood in: each reply is a Responses body with token info the size of a real
Workplace turn (``--prompt-tokens`` growing by ``--turn-tokens`` per turn, ``--generation-tokens``).

Per interval, ``--moved`` of the episodes finish one call, then a staged capture takes the model's records
(``take_capture``, as the control plane does at a ``capture`` prepare). Columns, per setting and interval:

- **call us**: thread CPU per call for the gate's work (the digest of the request and the serialisation of
  the call, once, at delivery, when recording);
- **capture ms**: thread CPU of the capture (GC frozen), which must follow the calls finished since the
  last one, not the history;
- **captured KB** and **KB/turn**: the capture's size, and what one finished turn adds to it per episode;
- **persist ms**: encoding the whole scope's lines, as ``persist`` does after resume.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from gym_patches.checkpoint.control.staging import take_capture  # noqa: E402
from gym_patches.checkpoint.model import PolicyModelParticipant  # noqa: E402

NAME = "replay_records"


def reply_for(turn: int, prompt_tokens: int, generation_tokens: int) -> dict[str, Any]:
    """A Responses reply the size of a Workplace tool-call turn (ids and logprobs as the converter writes them)."""
    return {"id": f"resp_{turn:032x}", "object": "response", "created_at": 1, "status": "completed",
            "model": "policy", "output": [{
                "id": f"fc_{turn:032x}", "type": "function_call", "call_id": f"call_{turn}", "status": "completed",
                "name": "calendar_create_event",
                "arguments": json.dumps({"title": "Sync", "start": "2024-03-05 10:00", "duration_minutes": 30,
                                         "attendee_email": "ana@hq.co"}),
                "prompt_token_ids": [random.randrange(32000) for _ in range(prompt_tokens)],
                "generation_token_ids": [random.randrange(32000) for _ in range(generation_tokens)],
                "generation_log_probs": [-random.random() for _ in range(generation_tokens)],
                "weight_version": 1}]}


def request_for(turn: int) -> dict[str, Any]:
    items: list[Any] = [{"role": "system", "content": "You are an office assistant. Use the tools."},
                        {"role": "user", "content": "Book a 30 minute sync with Ana tomorrow at 10."}]
    for k in range(turn):
        items.append({"id": f"fc_{k:032x}", "type": "function_call", "call_id": f"call_{k}", "status": "completed",
                      "name": "calendar_create_event", "arguments": "{}"})
        items.append({"type": "function_call_output", "call_id": f"call_{k}", "output": f"Created event E{k + 1}."})
    return {"input": items, "tools": [{"type": "function", "name": "calendar_create_event"}], "temperature": 1.0}


async def one_call(model: PolicyModelParticipant, key: str, body: dict[str, Any], reply: bytes) -> float:
    started = time.thread_time()
    async with model.call(key) as ticket:
        model.plan_call(ticket, body)
        await model.release_response(ticket)
        model.delivered(ticket, reply)
    return time.thread_time() - started


async def interval_rows(n: int, turns: int, moved: float, record: bool, args: argparse.Namespace) -> list[dict]:
    model = PolicyModelParticipant()
    model.record_calls = record
    keys = [f"r{i}" for i in range(n)]
    done = dict.fromkeys(keys, 0)
    rows = []
    previous = 0
    for interval in range(turns):
        movers = keys if interval == 0 else random.sample(keys, max(1, int(n * moved)))
        call_s = 0.0
        for key in movers:
            turn = done[key]
            reply = json.dumps(reply_for(turn, args.prompt_tokens + turn * args.turn_tokens,
                                         args.generation_tokens)).encode()
            call_s += await one_call(model, key, request_for(turn), reply)
            done[key] = turn + 1
        gc.collect()
        gc.freeze()
        started = time.thread_time()
        staged = await take_capture(model, "policy_model", f"snap-{interval}", [])
        capture_s = time.thread_time() - started
        gc.unfreeze()
        started = time.thread_time()
        _, encoded, _ = staged.select(tuple(staged.keys))
        persist_s = time.thread_time() - started
        total = staged.nbytes
        rows.append({"interval": interval, "moved": len(movers), "call_us": call_s / len(movers) * 1e6,
                     "capture_ms": capture_s * 1e3, "captured_kb": total / 1024,
                     "kb_per_turn": (total - previous) / 1024 / len(movers),  # one finished turn per mover
                     "persist_ms": persist_s * 1e3, "persisted_kb": encoded.nbytes / 1024})
        previous = total
    return rows


def measure(sizes: list[int], *, turns: int = 6, moved: float = 1.0, repeats: int = 3,
            args: argparse.Namespace | None = None) -> dict[str, Any]:
    """Each size, record_calls off and on: per interval, the median of ``repeats`` runs."""
    args = args or parse_args([])
    out: dict[str, Any] = {"name": NAME, "turns": turns, "moved": moved, "results": []}
    for n in sizes:
        for record in (False, True):
            runs = [asyncio.run(interval_rows(n, turns, moved, record, args)) for _ in range(repeats)]
            for interval in range(turns):
                cells = [r[interval] for r in runs]
                row = {k: statistics.median(c[k] for c in cells) for k in cells[0]}
                out["results"].append({"n": n, "record_calls": record, **row})
    return out


def table(res: dict[str, Any]) -> str:
    head = ("| N | record_calls | interval | moved | call us | capture ms | captured KB | KB/turn | persist ms |"
            " persisted KB |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in res["results"]:
        lines.append(f"| {r['n']} | {'on' if r['record_calls'] else 'off'} | {int(r['interval'])} | {int(r['moved'])} "
                     f"| {r['call_us']:.0f} | {r['capture_ms']:.2f} | {r['captured_kb']:.0f} | {r['kb_per_turn']:.2f} "
                     f"| {r['persist_ms']:.1f} | {r['persisted_kb']:.0f} |")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sizes", nargs="*", type=int, default=[512])
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--moved", type=float, default=1.0, help="share of the episodes that move per interval")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=400)
    parser.add_argument("--turn-tokens", type=int, default=60, help="prompt growth per turn")
    parser.add_argument("--generation-tokens", type=int, default=40)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    random.seed(0)
    print(table(measure(args.sizes, turns=args.turns, moved=args.moved, repeats=args.repeats, args=args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
