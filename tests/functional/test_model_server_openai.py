"""The policy model server as the official ``openai`` client sees it.

A real model server process on loopback, in front of (a) the project's scripted
test backend and (b) ``RefusingBackend``, a FAKE chat-completions backend used
only to isolate the backend's error replies (4xx in the shapes vLLM, FastAPI
and OpenAI-compatible servers use). Every reply is validated strictly with the
client's own ``Response`` type, and every error must raise the client's usual
exception after exactly one HTTP request.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from typing import Any

import pytest
from aiohttp import web

from gym_patches.launch import GymDeployment
from gym_patches.fakes.scripted_backend import ScriptedBackend
from gym_patches.utils.processes import free_port

openai = pytest.importorskip("openai")
from openai.types.responses import Response  # noqa: E402

pytestmark = pytest.mark.functional

ADD_TOOL = {
    "type": "function",
    "name": "add",
    "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
}


def gym_config(policy_base_url: str) -> dict:
    return {
        "checkpoint": {"enabled": True, "control_auth_token": "openai-test-token"},
        "policy_base_url": policy_base_url,
        "policy_model_name": "test-policy",
        "policy_api_key": "backend-key",
        "policy_model": {"responses_api_models": {"vllm_model": {"request_timeout_s": 30}}},
    }


class CountingClient:
    """An ``openai.OpenAI`` client that counts the HTTP requests it really sends."""

    def __init__(self, base_url: str, *, max_retries: int = 2):
        self.sent = 0
        # the client's own HTTP client class (httpx or its successor), with a request hook
        http = openai.DefaultHttpxClient(event_hooks={"request": [self._count]}, timeout=30)
        self.client = openai.OpenAI(base_url=base_url, api_key="not-checked", max_retries=max_retries,
                                    http_client=http)

    def _count(self, _request: Any) -> None:
        self.sent += 1

    def create(self, **kw: Any):
        """``responses.create``; the raw JSON must pass the client's strict ``Response`` type."""
        raw = self.client.responses.with_raw_response.create(**kw)
        Response.model_validate(json.loads(raw.http_response.text))  # raises on any missing required field
        return raw.parse()

    def close(self) -> None:
        self.client.close()


# -- in front of the scripted backend ----------------------------------------------------------------
@pytest.fixture(scope="module")
def scripted():
    with ScriptedBackend().start() as backend:
        with GymDeployment.start(gym_config(backend.base_url)) as dep:
            yield backend, dep.url("policy_model")


@pytest.fixture
def client(scripted):
    backend, url = scripted
    backend.reset()
    c = CountingClient(f"{url}/ng-rollout/oc1/v1")
    yield c
    c.close()
    backend.reset()


def test_openai_client_reads_every_reply_with_its_own_types(scripted, client):
    backend, _ = scripted
    user = "What is 2+2?"
    backend.set_plans({user: [{"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 2}}]}, {"content": "4"}]})
    before = time.time()
    first = client.create(model="test-policy", input=user, tools=[ADD_TOOL], temperature=0.0)
    assert isinstance(first, Response)
    assert first.created_at is not None and before - 5 <= first.created_at <= time.time() + 5
    assert first.status == "completed" and first.error is None
    assert first.tool_choice == "auto" and first.parallel_tool_calls is True
    assert [t.name for t in first.tools] == ["add"] and first.tools[0].parameters == ADD_TOOL["parameters"]
    (call,) = first.output
    assert call.type == "function_call" and call.id and call.id.startswith("fc_") and call.status == "completed"
    assert call.name == "add" and json.loads(call.arguments) == {"a": 2, "b": 2}
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert first.usage.output_tokens_details.reasoning_tokens == 0
    assert first.usage.output_tokens == len(call.model_extra["generation_token_ids"])  # training info rides along

    second = client.create(
        model="test-policy",
        input=[{"role": "user", "content": user},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "4"}],
        tools=[ADD_TOOL],
        tool_choice="none",
        parallel_tool_calls=False,
        instructions="Answer with a number.",
    )
    (message,) = second.output
    assert second.output_text == "4"
    assert message.type == "message" and message.id.startswith("msg_") and message.status == "completed"
    assert message.content[0].annotations == []
    assert second.tool_choice == "none" and second.parallel_tool_calls is False
    assert second.instructions == "Answer with a number."
    assert second.id != first.id and message.id != call.id

    cut = client.create(model="test-policy", input=user, max_output_tokens=2)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output[0].status == "incomplete" and cut.max_output_tokens == 2
    assert client.sent == 3


def test_the_scripted_backend_works_on_at_most_max_num_seqs_replies_at_once(scripted):
    """The fake's ``max_num_seqs`` (a server's batch bound, as vLLM's): the other calls wait their turn."""
    backend, url = scripted
    backend.reset()
    user = "batched"
    backend.set_plans({user: [{"content": "ok"}]})
    backend.configure(delay_s=1.0, max_num_seqs=3)

    async def send_all() -> tuple[list[Any], list[dict[str, Any]]]:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="not-checked", max_retries=0, timeout=60)
        seen = []
        try:
            calls = [asyncio.create_task(client.with_options(base_url=f"{url}/ng-rollout/batch{i}/v1").responses.create(
                model="test-policy", input=user)) for i in range(9)]
            while not all(c.done() for c in calls):
                seen.append(await asyncio.to_thread(backend.state))
                await asyncio.sleep(0.1)
            return await asyncio.gather(*calls), seen
        finally:
            await client.close()

    try:
        replies, seen = asyncio.run(send_all())
    finally:
        backend.configure(delay_s=0.0, max_num_seqs=0)
        backend.reset()
    assert [r.output_text for r in replies] == ["ok"] * 9
    assert max(s["working"] for s in seen) == 3, [s["working"] for s in seen]
    assert any(s["pending"] == 9 and s["working"] == 3 for s in seen), [(s["pending"], s["working"]) for s in seen]


FAN_OUT = 300  # more calls at once than aiohttp's default connection cap (100)


def test_every_concurrent_call_reaches_the_backend_at_once(scripted):
    """Thousands of rollouts each hold a model call; the model server must pass all of them to the
    backend at once, not 100 at a time (a capped client session queued the rest invisibly)."""
    backend, url = scripted
    backend.reset()
    user = "fan out"
    backend.set_plans({user: [{"content": "ok"}]})
    backend.hold(user, 0)

    async def send_all() -> list[Any]:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="not-checked", max_retries=0, timeout=120)
        try:  # one rollout (capture key) per call, all on the client's one connection pool
            calls = [asyncio.create_task(client.with_options(base_url=f"{url}/ng-rollout/fan{i}/v1").responses.create(
                model="test-policy", input=user)) for i in range(FAN_OUT)]
            deadline = time.monotonic() + 60
            held = 0
            while time.monotonic() < deadline:
                held = (await asyncio.to_thread(backend.state))["held"]
                if held >= FAN_OUT:
                    break
                await asyncio.sleep(0.2)
            assert held == FAN_OUT, f"only {held} of {FAN_OUT} concurrent calls reached the backend"
            assert await asyncio.to_thread(backend.release, user, 0)
            return await asyncio.gather(*calls)
        finally:
            await client.close()

    try:
        replies = asyncio.run(send_all())
    finally:
        backend.reset()
    assert [r.output_text for r in replies] == ["ok"] * FAN_OUT


@pytest.mark.parametrize(
    "kwargs, param, fragment",
    [
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "input[0].role"),
        ({"input": []}, "input", "at least one item"),
        ({"input": 5}, "input", "valid string"),
        ({"input": "hi", "temperature": "hot"}, "temperature", "valid number"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type", "only 'function' tools"),
        ({"input": "hi", "stream": False, "extra_body": {"stream": True}}, "stream", "streaming"),
    ],
)
def test_invalid_requests_raise_bad_request_error_once(client, kwargs, param, fragment):
    with pytest.raises(openai.BadRequestError) as caught:
        client.client.responses.create(model="test-policy", **kwargs)
    err = caught.value
    assert err.status_code == 400 and err.code == "invalid_request" and err.param == param
    assert err.type == "invalid_request_error" and fragment in err.message
    assert client.sent == 1, "a 400 is never retried"


def test_stale_attempt_is_a_conflict_error_the_client_does_not_retry(scripted):
    backend, url = scripted
    def control(op: str, body: dict) -> int:
        req = urllib.request.Request(
            f"{url}/ng-control/v1/checkpoint/{op}", data=json.dumps(body).encode(), method="POST",
            headers={"Authorization": "Bearer openai-test-token", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=20) as resp:
            return resp.status

    assert control("retire", {"checkpoint_id": "oc-retire", "deadline_ts": time.time() + 20,
                              "episode_ids": [{"rollout_id": "oc9"}]}) == 200
    c = CountingClient(f"{url}/ng-rollout/oc9/v1")
    try:
        with pytest.raises(openai.ConflictError) as caught:
            c.client.responses.create(model="test-policy", input="hi")
        assert caught.value.code == "stale_attempt" and "oc9" in caught.value.message
        assert c.sent == 1
    finally:
        c.close()
        control("resume", {"checkpoint_id": "oc-retire", "deadline_ts": time.time() + 20})


# -- in front of a FAKE backend that refuses ---------------------------------------------------------
CONTEXT_LIMIT_CHARS = 40


class RefusingBackend:
    """FAKE chat-completions backend (not a policy), only to isolate backend errors.

    Answers ``/v1/chat/completions`` with the error the user text (or top_p) asks
    for, in the body shapes real backends use; anything else gets a fixed reply.
    """

    def __init__(self) -> None:
        self.port = free_port()
        self.received: list[dict[str, Any]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="refusing-backend", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> "RefusingBackend":
        self._thread.start()
        assert self._ready.wait(10), "fake backend did not start"
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._loop is not None and self._runner is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _serve(self) -> None:
        self._loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.received.append(body)
        text = next(m["content"] for m in body["messages"] if m["role"] == "user")
        if body.get("top_p") not in (None, 1, 1.0):
            return web.json_response({"error": {"message": "only top_p=1 is supported",
                                                "type": "invalid_request_error", "param": "top_p", "code": None}},
                                     status=400)
        if len(text) > CONTEXT_LIMIT_CHARS:
            return web.json_response({"error": {
                "message": f"This model's maximum context length is {CONTEXT_LIMIT_CHARS} tokens; "
                           f"the prompt has {len(text)}.",
                "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}},
                status=400)
        shapes: dict[str, tuple[int, Any]] = {
            "vllm-shape": (400, {"object": "error", "message": "vllm says no", "type": "BadRequestError",
                                 "param": None, "code": 400}),
            "fastapi-shape": (422, {"detail": [{"loc": ["body", "messages"], "msg": "Field required"}]}),
            "gym-shape": (422, {"error": {"code": "invalid_request", "detail": "messages: bad"}}),
            "rate-limited": (429, {"error": {"message": "slow down", "type": "rate_limit_error", "code": None}}),
            "bad-key": (401, {"error": {"message": "invalid api key", "type": "authentication_error"}}),
            "no-such-model": (404, {"error": {"message": "model test-policy does not exist"}}),
            "crash": (500, {"error": {"message": "engine died"}}),
        }
        if text == "plain-text":
            return web.Response(status=400, text="plain refusal")
        if text in shapes:
            status, payload = shapes[text]
            return web.json_response(payload, status=status)
        return web.json_response({"id": "c1", "model": body["model"], "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "fine"}, "finish_reason": "stop"}]})


@pytest.fixture(scope="module")
def refusing():
    with RefusingBackend() as backend:
        with GymDeployment.start(gym_config(backend.base_url)) as dep:
            yield backend, dep.url("policy_model")


@pytest.mark.parametrize(
    "kwargs, exc_type, status, message, param, code",
    [
        ({"input": "hi", "top_p": 0.5}, openai.BadRequestError, 400, "only top_p=1 is supported", "top_p", None),
        ({"input": "x" * (CONTEXT_LIMIT_CHARS + 1)}, openai.BadRequestError, 400,
         f"maximum context length is {CONTEXT_LIMIT_CHARS} tokens", "messages", "context_length_exceeded"),
        ({"input": "vllm-shape"}, openai.BadRequestError, 400, "vllm says no", None, None),
        ({"input": "fastapi-shape"}, openai.UnprocessableEntityError, 422, "Field required", None, None),
        ({"input": "gym-shape"}, openai.UnprocessableEntityError, 422, "messages: bad", None, "invalid_request"),
        ({"input": "plain-text"}, openai.BadRequestError, 400, "plain refusal", None, None),
    ],
)
def test_backend_4xx_passes_through_and_is_not_retried(refusing, kwargs, exc_type, status, message, param, code):
    backend, url = refusing
    backend.received.clear()
    c = CountingClient(f"{url}/ng-rollout/rb1/v1")
    try:
        with pytest.raises(exc_type) as caught:
            c.client.responses.create(model="test-policy", **kwargs)
    finally:
        c.close()
    err = caught.value
    assert err.status_code == status and message in err.message
    assert err.param == param and err.code == code
    assert set(err.body) == {"message", "type", "param", "code"}, err.body
    assert c.sent == 1 and len(backend.received) == 1, "refused once, asked once"


def test_backend_429_passes_through_and_stays_retryable(refusing):
    backend, url = refusing
    backend.received.clear()
    c = CountingClient(f"{url}/v1", max_retries=1)
    try:
        with pytest.raises(openai.RateLimitError) as caught:
            c.client.responses.create(model="test-policy", input="rate-limited")
    finally:
        c.close()
    assert caught.value.status_code == 429 and "slow down" in caught.value.message
    assert c.sent == 2 and len(backend.received) == 2  # the client's own retry policy applies


@pytest.mark.parametrize("text, shown", [("bad-key", "401"), ("no-such-model", "404"), ("crash", "500")])
def test_backend_settings_errors_and_5xx_are_502_naming_the_backend(refusing, text, shown):
    backend, url = refusing
    c = CountingClient(f"{url}/v1", max_retries=1)
    try:
        with pytest.raises(openai.InternalServerError) as caught:
            c.client.responses.create(model="test-policy", input=text)
    finally:
        c.close()
    assert c.sent == 2, "a 5xx stays retryable (and the request counter counts retries)"
    err = caught.value
    assert err.status_code == 502 and err.code == "backend_error" and err.type == "server_error"
    assert f"{backend.base_url}/chat/completions" in err.message and shown in err.message


def test_a_good_reply_through_the_fake_is_a_valid_response(refusing):
    _, url = refusing
    c = CountingClient(f"{url}/v1")
    try:
        reply = c.create(model="test-policy", input="hello", top_p=1.0, metadata={"run": "r1"})
    finally:
        c.close()
    assert reply.output_text == "fine" and reply.top_p == 1.0 and reply.metadata == {"run": "r1"}


def test_a_rejected_model_request_ends_the_episode_instead_of_failing_the_rollout():
    """A 4xx from the model (here: a prompt over the context length, through the fake backend) is not an
    infrastructure failure: simple_agent ends the episode as ``model_rejected`` and verifies it (reward 0),
    so RL trains on it instead of retrying a rollout that would only meet the same refusal."""
    from pathlib import Path

    row = json.loads((Path(__file__).resolve().parents[2] / "examples/data/workplace_train.jsonl").read_text()
                     .splitlines()[0])
    row["responses_create_params"]["input"][1]["content"] = "x" * (CONTEXT_LIMIT_CHARS + 1)
    cfg = gym_config("")
    cfg.update({
        "workplace_assistant": {"resources_servers": {"workplace_assistant": {}}},
        "agent": {"responses_api_agents": {"simple_agent": {
            "max_steps": 4, "model_server": {"type": "responses_api_models", "name": "policy_model"},
            "resources_server": {"type": "resources_servers", "name": "workplace_assistant"}}}},
    })
    with RefusingBackend() as backend:
        cfg["policy_base_url"] = backend.base_url
        with GymDeployment.start(cfg) as dep:
            req = urllib.request.Request(
                dep.url("agent") + "/run", data=json.dumps({**row, "_ng_rollout_id": "long-prompt-1"}).encode(),
                headers={"Content-Type": "application/json"}, method="POST")
            with urllib.request.urlopen(req, timeout=30) as resp:
                reply = json.loads(resp.read())
    assert reply["termination_reason"] == "model_rejected"
    assert reply["reward"] == 0.0 and reply["num_model_calls"] == 0
    assert len(backend.received) == 1  # asked once, not retried
