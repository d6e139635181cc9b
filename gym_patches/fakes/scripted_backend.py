"""Scripted chat-completions server: a named fake, not a policy.

Serves OpenAI-compatible ``POST /v1/chat/completions`` in its own process
(``python -m gym_patches.fakes.scripted_backend --port N``) so Gym tests
exercise a real model server over real HTTP with answers they can predict.

Plans are keyed by the text of the first user message. A plan is a list of
assistant turns; the turn a request asks for is the number of assistant
messages already in ``messages``. A turn is ``{"tool_calls": [{"name",
"arguments": {...}}]}`` and/or ``{"content": "text"}``. Past the end of a plan
the reply is the final text ``"Done."``; without a plan it is ``"I cannot
help."``.

Token ids and logprobs in replies are FAKE but deterministic: prompt ids are
the UTF-8 bytes of the rendered messages, generation ids the bytes of the
reply text, and each logprob is derived from its byte. ``weight_version`` is
always 0. ``max_tokens`` truncates the fake generation (finish "length").

Replies can take wall-clock time without using the CPU (they sleep): a fixed
``delay_s`` plus up to ``jitter_s``, and, with ``tokens_per_s`` set, a stand-in
for a generation device (``SimulatedDecoder``) that decodes that many fake
tokens per second, shared by the replies in flight: a reply of k tokens alone
takes k / ``tokens_per_s``, n of them at once each get 1/n of the rate. The
device's throughput is fixed, as an accelerator's is, so generating two steps'
rollouts at once takes as long as generating them one after the other; that is
what lets throughput benchmarks give generation its own timeline
(docs/benchmarks.md, "Async on simulated devices").

Control routes under ``/scripted/`` let a test hold a given turn's reply,
release it, and read back which calls completed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import json
import re
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Iterable

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gym_patches.checkpoint.cuts import CALL_ID_HEADER, CALL_INDEX_HEADER, RESEND_HEADER
from gym_patches.utils.processes import signals_blocked

FINAL_TEXT = "Done."
NO_PLAN_TEXT = "I cannot help."
WEIGHT_VERSION = 0

Key = tuple[str, int]  # (first user message text, turn index)


# -- plans ---------------------------------------------------------------------
class ScriptedToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)


class SettingsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    delay_s: float | None = Field(default=None, ge=0.0, le=600.0)
    jitter_s: float | None = Field(default=None, ge=0.0, le=600.0)
    tokens_per_s: float | None = Field(default=None, ge=0.0, le=1e9)  # 0: a reply's length costs no time
    max_num_seqs: int | None = Field(default=None, ge=0, le=1_000_000)  # 0: no bound on replies worked on at once
    respect_max_tokens: bool | None = None


class ScriptedTurn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tool_calls: list[ScriptedToolCall] | None = None
    content: str | None = None
    # This reply waits this long instead of the backend's delay_s (a row's ``scripted_first_reply_delay_s``:
    # the fake's way to make one row slow, e.g. a validation that outlasts a stop's grace).
    delay_s: float | None = Field(default=None, ge=0.0, le=600.0)

    @model_validator(mode="after")
    def _has_something(self) -> "ScriptedTurn":
        if not self.tool_calls and self.content is None:
            raise ValueError("a turn needs 'tool_calls' or 'content'")
        return self


class PlansRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    plans: dict[str, list[ScriptedTurn]] = Field(default_factory=dict)
    # Several plans for one user text (rows that differ only in seeded data): the
    # backend plays the variant whose next tool arguments appear in the tool outputs so far.
    variants: dict[str, list[list[ScriptedTurn]]] = Field(default_factory=dict)
    replace: bool = False  # False: add/override per user text; True: drop all others


class TurnRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    user: str
    turn: int = Field(ge=0)


def message_text(content: Any) -> str:
    """Text of a chat message's content (string or list of text parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def fake_logprob(token_id: int) -> float:
    return -round(((token_id * 37) % 97 + 1) / 50.0, 4)


# -- server --------------------------------------------------------------------
class SimulatedDecoder:
    """A stand-in for a generation device, not a model: it decodes ``rate`` fake tokens per second in
    wall-clock time, shared equally by the replies in flight (processor sharing), sleeping.

    A reply of k tokens alone is done after k / rate seconds, never sooner; with others in flight it
    takes longer, so the work a device can do per second is fixed. ``rate`` 0: decoding takes no time.
    """

    EPS_TOKENS = 1e-6

    def __init__(self) -> None:
        self.rate = 0.0
        self._left: dict[asyncio.Future, float] = {}  # reply -> tokens still to decode
        self._since = 0.0  # when ``_left`` was last brought up to date
        self._timer: asyncio.TimerHandle | None = None

    async def decode(self, tokens: int) -> None:
        if not self.rate or tokens <= 0:
            return
        loop = asyncio.get_running_loop()
        self._advance(loop)
        done = loop.create_future()
        self._left[done] = float(tokens)
        self._schedule(loop)
        try:
            await done
        finally:
            if done in self._left:  # cancelled (the client went away): its share goes to the others
                self._advance(loop)
                del self._left[done]
                self._schedule(loop)

    def set_rate(self, rate: float) -> None:
        """A new rate from now on; replies in flight keep what they decoded (0: the rest take no time)."""
        loop = asyncio.get_running_loop()
        self._advance(loop)
        self.rate = float(rate)
        if not self.rate:
            for reply in self._left:
                self._left[reply] = 0.0
        self._schedule(loop)

    def _advance(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        if self._left:
            each = (now - self._since) * self.rate / len(self._left)
            for reply in self._left:
                self._left[reply] -= each
        self._since = now

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for reply in [r for r, left in self._left.items() if left <= self.EPS_TOKENS]:
            del self._left[reply]
            if not reply.done():
                reply.set_result(None)
        if self._left:
            wait = min(self._left.values()) * len(self._left) / self.rate
            self._timer = loop.call_later(wait, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        self._advance(loop)
        self._schedule(loop)


class ScriptedState:
    def __init__(self) -> None:
        self.plans: dict[str, list[list[ScriptedTurn]]] = {}  # user text -> variants
        self.holds: dict[Key, asyncio.Event] = {}
        self.waiting: dict[Key, int] = {}  # replies currently held, per turn
        self.calls: list[dict[str, Any]] = []
        self.pending = 0
        self.working = 0  # replies being worked on (past the ``max_num_seqs`` bound)
        self.delay_s = 0.0  # every reply waits this long (keeps rollouts in flight in RL tests)
        self.jitter_s = 0.0  # plus up to this long more, drawn from a fixed-seed generator
        self.jitter = random.Random(0)
        self.decoder = SimulatedDecoder()  # rate > 0: replies also wait for the simulated device to decode them
        self.respect_max_tokens = True  # False: plans play out whole (fake tokens are bytes, not words)
        self.max_num_seqs = 0  # > 0: at most this many replies are worked on at once (a server's batch)
        self.batch: asyncio.Semaphore | None = None

    async def work_on(self, turn: "ScriptedTurn", tokens: int) -> None:
        """A reply's time: its turn's wait and the simulated decode of its ``tokens``, inside the batch
        bound (``max_num_seqs``) when one is set."""
        async with self.batch or contextlib.nullcontext():
            self.working += 1
            try:
                wait = self.wait_for(turn)
                if wait:
                    await asyncio.sleep(wait)
                await self.decoder.decode(tokens)
            finally:
                self.working -= 1

    def set_max_num_seqs(self, n: int) -> None:
        """Bound the replies worked on at once; calls past it wait their turn, as in a server's queue."""
        self.max_num_seqs = n
        self.batch = asyncio.Semaphore(n) if n > 0 else None

    def turn_for(self, user: str, turn: int, tool_text: str = "") -> ScriptedTurn:
        variants = self.plans.get(user)
        if not variants:
            return ScriptedTurn(content=NO_PLAN_TEXT)
        plan = max(variants, key=lambda v: _evidence(v, turn, tool_text))
        return plan[turn] if turn < len(plan) else ScriptedTurn(content=FINAL_TEXT)


    def wait_for(self, turn: ScriptedTurn) -> float:
        """Seconds a reply waits before it is sent: the turn's own delay, else delay_s plus jitter."""
        if turn.delay_s is not None:
            return turn.delay_s
        return self.delay_s + (self.jitter.uniform(0.0, self.jitter_s) if self.jitter_s else 0.0)

    def release(self, key: Key) -> bool:
        event = self.holds.pop(key, None)
        if event is not None:
            event.set()
        return event is not None


_WORD = re.compile(r"[A-Za-z0-9@._-]+")


def _evidence(plan: list[ScriptedTurn], turn: int, tool_text: str) -> int:
    """How many of the turn's string arguments the conversation's tool outputs mention."""
    if turn >= len(plan):
        return 0
    values = [v for c in plan[turn].tool_calls or [] for v in c.arguments.values() if isinstance(v, str)]
    seen = set(_WORD.findall(tool_text))
    # Whole values (emails, ids) count most; single words (numbers in code) break the remaining ties.
    return sum(100 for v in values if v and v in tool_text) + sum(1 for v in values for w in _WORD.findall(v) if w in seen)


def _error(status: int, code: str, detail: str) -> web.Response:
    return web.json_response({"error": {"code": code, "detail": detail}}, status=status)


async def _body(request: web.Request, model: type[BaseModel]) -> BaseModel:
    try:
        return model.model_validate(await request.json())
    except ValueError as exc:  # JSON or validation error
        detail = str(exc) if isinstance(exc, ValidationError) else "body is not valid JSON"
        raise web.HTTPUnprocessableEntity(
            text=json.dumps({"error": {"code": "invalid_request", "detail": detail}}), content_type="application/json"
        ) from None


def build_app() -> web.Application:
    state = ScriptedState()

    async def chat(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(422, "invalid_request", "body is not valid JSON")
        messages = body.get("messages") if isinstance(body, dict) else None
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            return _error(422, "invalid_request", "messages: must be a non-empty list of objects")
        max_tokens = body.get("max_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            return _error(422, "invalid_request", "max_tokens: must be a positive integer")
        user = next((message_text(m.get("content")) for m in messages if m.get("role") == "user"), "")
        turn_index = sum(1 for m in messages if m.get("role") == "assistant")
        key = (user, turn_index)
        state.pending += 1
        try:
            hold = state.holds.get(key)
            if hold is not None:
                state.waiting[key] = state.waiting.get(key, 0) + 1
                try:
                    await hold.wait()
                finally:
                    state.waiting[key] -= 1
                    if not state.waiting[key]:
                        del state.waiting[key]
            limit = max_tokens if state.respect_max_tokens else None
            tool_text = "\n".join(message_text(m.get("content")) for m in messages if m.get("role") == "tool")
            turn = state.turn_for(user, turn_index, tool_text)
            reply = _completion(messages, turn, turn_index, body.get("model"), limit)
            await state.work_on(turn, reply["usage"]["completion_tokens"])
            state.calls.append(
                {
                    "user": user,
                    "turn": turn_index,
                    "ts": time.time(),
                    "model": body.get("model"),
                    "authorization": request.headers.get("Authorization"),
                    "call_id": request.headers.get(CALL_ID_HEADER),
                    "call_index": request.headers.get(CALL_INDEX_HEADER),
                    "resend": request.headers.get(RESEND_HEADER),
                }
            )
            return web.json_response(reply)
        finally:
            state.pending -= 1

    async def set_plans(request: web.Request) -> web.Response:
        req = await _body(request, PlansRequest)
        if req.replace:
            state.plans.clear()
        state.plans.update({user: [plan] for user, plan in req.plans.items()})
        state.plans.update(req.variants)
        return web.json_response({"plans": len(state.plans)})

    async def hold(request: web.Request) -> web.Response:
        req = await _body(request, TurnRequest)
        state.holds.setdefault((req.user, req.turn), asyncio.Event())
        return web.json_response({"held": True})

    async def release(request: web.Request) -> web.Response:
        req = await _body(request, TurnRequest)
        return web.json_response({"released": state.release((req.user, req.turn))})

    async def calls(_: web.Request) -> web.Response:
        return web.json_response(
            {
                "calls": state.calls,
                "pending": state.pending,
                "working": state.working,
                "held": sum(state.waiting.values()),
                "held_turns": [{"user": u, "turn": t, "waiting": n} for (u, t), n in state.waiting.items()],
            }
        )

    async def settings(request: web.Request) -> web.Response:
        req = await _body(request, SettingsRequest)
        if req.delay_s is not None:
            state.delay_s = req.delay_s
        if req.jitter_s is not None:
            state.jitter_s = req.jitter_s
        if req.tokens_per_s is not None:
            state.decoder.set_rate(req.tokens_per_s)
        if req.respect_max_tokens is not None:
            state.respect_max_tokens = req.respect_max_tokens
        if req.max_num_seqs is not None:
            state.set_max_num_seqs(req.max_num_seqs)
        return web.json_response({"delay_s": state.delay_s, "jitter_s": state.jitter_s,
                                  "tokens_per_s": state.decoder.rate, "max_num_seqs": state.max_num_seqs,
                                  "respect_max_tokens": state.respect_max_tokens})

    async def reset(_: web.Request) -> web.Response:
        for key in list(state.holds):
            state.release(key)
        state.plans.clear()
        state.calls.clear()
        return web.json_response({"reset": True})

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"ok": True, "name": "scripted_backend"})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/scripted/plans", set_plans)
    app.router.add_post("/scripted/hold", hold)
    app.router.add_post("/scripted/settings", settings)
    app.router.add_post("/scripted/release", release)
    app.router.add_get("/scripted/calls", calls)
    app.router.add_post("/scripted/reset", reset)
    app.router.add_get("/health", health)
    return app


def _render_prompt(messages: list[dict[str, Any]]) -> str:
    parts = []
    for m in messages:
        calls = json.dumps(m["tool_calls"], sort_keys=True) if m.get("tool_calls") else ""
        parts.append(f"<{m.get('role')}>{message_text(m.get('content'))}{calls}")
    return "".join(parts)


def _completion(
    messages: list[dict[str, Any]], turn: ScriptedTurn, turn_index: int, model: Any, max_tokens: int | None
) -> dict[str, Any]:
    tool_calls = [
        {
            "id": f"call_t{turn_index}_{j}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments, sort_keys=True)},
        }
        for j, c in enumerate(turn.tool_calls or [])
    ]
    content = turn.content
    generated = (content or "") + "".join(c["function"]["name"] + c["function"]["arguments"] for c in tool_calls)
    gen_ids = list(generated.encode("utf-8"))
    finish = "tool_calls" if tool_calls else "stop"
    if max_tokens is not None and len(gen_ids) > max_tokens:
        gen_ids = gen_ids[:max_tokens]
        content = bytes(gen_ids).decode("utf-8", errors="ignore")
        tool_calls, finish = [], "length"
    prompt_ids = list(_render_prompt(messages).encode("utf-8"))
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:16]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model if isinstance(model, str) else "scripted",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(gen_ids),
            "total_tokens": len(prompt_ids) + len(gen_ids),
        },
        "prompt_token_ids": prompt_ids,
        "generation_token_ids": gen_ids,
        "generation_log_probs": [fake_logprob(t) for t in gen_ids],
        "weight_version": WEIGHT_VERSION,
    }


# -- sync handle for tests -----------------------------------------------------
class ScriptedBackendError(RuntimeError):
    pass


class ScriptedBackend:
    """Starts and drives a scripted backend process; ``stop()`` reaps it."""

    def __init__(self, host: str = "127.0.0.1", startup_timeout_s: float = 30.0):
        self.host = host
        self.port: int | None = None
        self.startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen | None = None
        self._log_path: Path | None = None

    # -- lifecycle --
    def start(self, port: int = 0) -> "ScriptedBackend":
        from gym_patches.utils.processes import die_with_parent, free_port

        if self._proc is not None:
            raise ScriptedBackendError("scripted backend already started")
        attempts = 3 if port == 0 else 1
        for attempt in range(attempts):
            self.port = port or free_port(self.host)
            fd, log = tempfile.mkstemp(prefix="scripted-backend-", suffix=".log")
            self._log_path = Path(log)
            env = dict(os.environ)
            repo_root = str(Path(__file__).resolve().parents[2])
            env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH", "")) if p)
            with os.fdopen(fd, "wb") as log_file:
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "gym_patches.fakes.scripted_backend", "--host", self.host,
                     "--port", str(self.port)],
                    env=env, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    preexec_fn=die_with_parent,
                )
            try:
                self._wait_healthy()
                return self
            except ScriptedBackendError:
                self.stop()
                if attempt == attempts - 1:
                    raise
        return self

    def _wait_healthy(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self._proc.poll() is not None:
                raise ScriptedBackendError(
                    f"scripted backend exited with code {self._proc.returncode} during startup:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1.0) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise ScriptedBackendError(f"scripted backend not up after {self.startup_timeout_s:g}s")
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop the process (idempotent) and remove its log."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            # Started with SIGTERM blocked (a run that keeps its children through a stop signal): kill.
            proc.send_signal(signal.SIGKILL if signals_blocked() else signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._log_path is not None:
            self._log_path.unlink(missing_ok=True)

    def log_tail(self, lines: int = 30) -> str:
        if self._log_path is None or not self._log_path.exists():
            return "(no log)"
        return "\n".join(self._log_path.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> "ScriptedBackend":
        return self if self._proc is not None else self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- addresses --
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """What a Gym config's ``policy_base_url`` should be."""
        return f"{self.url}/v1"

    # -- control --
    def _call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode("utf-8")
        req = urllib.request.Request(f"{self.url}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10.0) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            raise ScriptedBackendError(f"scripted backend {method} {path} -> {exc.code}: {exc.read()[:500]!r}") from None

    def set_plans(self, plans: dict[str, list[dict[str, Any]]], *, replace: bool = True) -> None:
        self._call("POST", "/scripted/plans", {"plans": plans, "replace": replace})

    def plans_from_rows(self, rows: Iterable[dict[str, Any]], *, replace: bool = True) -> dict[str, list[dict[str, Any]]]:
        """Plan each task row: one turn per ground-truth call, then its final answer."""
        variants: dict[str, list[list[dict[str, Any]]]] = {}
        for row in rows:
            plan = plan_for_row(row)
            bucket = variants.setdefault(first_user_text(row), [])
            if plan not in bucket:
                bucket.append(plan)
        self._call("POST", "/scripted/plans", {"variants": variants, "replace": replace})
        return {user: plans[0] for user, plans in variants.items()}

    def configure(self, *, delay_s: float | None = None, respect_max_tokens: bool | None = None,
                  jitter_s: float | None = None, tokens_per_s: float | None = None,
                  max_num_seqs: int | None = None) -> dict[str, Any]:
        """``delay_s``: every reply waits that long (plus up to ``jitter_s``); ``tokens_per_s``: then for
        a simulated device decoding that many tokens per second, shared by the replies in flight (a
        reply of k tokens alone: k / rate more; 0 turns it off); ``max_num_seqs``: at most that many
        replies worked on at once, the rest wait their turn (0: no bound);
        ``respect_max_tokens=False``: plans are never cut. Returns the settings now in force."""
        return self._call("POST", "/scripted/settings",
                          {"delay_s": delay_s, "jitter_s": jitter_s, "tokens_per_s": tokens_per_s,
                           "max_num_seqs": max_num_seqs, "respect_max_tokens": respect_max_tokens})

    def hold(self, user: str, turn: int) -> None:
        self._call("POST", "/scripted/hold", {"user": user, "turn": turn})

    def release(self, user: str, turn: int) -> bool:
        return bool(self._call("POST", "/scripted/release", {"user": user, "turn": turn})["released"])

    def state(self) -> dict[str, Any]:
        """``{calls, pending, held, held_turns}``."""
        return self._call("GET", "/scripted/calls")

    def calls(self, user: str | None = None) -> list[dict[str, Any]]:
        """Completed calls ``{user, turn, ts, model, authorization}`` in completion order."""
        return [c for c in self.state()["calls"] if user is None or c["user"] == user]

    def wait_for_held(self, user: str, turn: int, timeout: float = 10.0) -> None:
        """Return once a reply for ``(user, turn)`` is waiting on its hold."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(h["user"] == user and h["turn"] == turn for h in self.state()["held_turns"]):
                return
            time.sleep(0.02)
        raise TimeoutError(f"no held reply for turn {turn} of {user!r} after {timeout:g}s")

    def reset(self) -> None:
        self._call("POST", "/scripted/reset", {})


def first_user_text(row: dict[str, Any]) -> str:
    """The plan key of a task row: its first user message text."""
    input_ = row.get("responses_create_params", {}).get("input")
    if isinstance(input_, str):
        return input_
    for item in input_ or []:
        if isinstance(item, dict) and item.get("role") == "user":
            return message_text(item.get("content"))
    raise ValueError(f"task row {row.get('id')!r} has no user message in responses_create_params.input")


def plan_for_row(row: dict[str, Any]) -> list[dict[str, Any]]:
    """One turn per ground-truth call, then the final answer; ``scripted_first_reply_delay_s`` (a
    row key only this fake reads) makes the first reply wait that long."""
    turns: list[dict[str, Any]] = [
        {"tool_calls": [{"name": call["name"], "arguments": call.get("arguments", {})}]}
        for call in row.get("ground_truth") or []
    ]
    final = row.get("final_answer")
    if final is not None:
        turns.append({"content": final if isinstance(final, str) else json.dumps(final)})
    slow = row.get("scripted_first_reply_delay_s")
    if slow is not None and turns:
        turns[0]["delay_s"] = float(slow)
    return turns


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Scripted chat-completions test backend (not a policy).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    web.run_app(build_app(), host=args.host, port=args.port, print=None, shutdown_timeout=1.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
