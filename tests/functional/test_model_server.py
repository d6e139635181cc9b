"""The policy model server as a real process in front of the scripted backend:
Responses mapping, errors, and the checkpoint gate over real HTTP."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import aiohttp
import pytest

from gym_patches.launch import GymDeployment
from gym_patches.fakes.scripted_backend import ScriptedBackend, fake_logprob
from gym_patches.utils.processes import free_port

pytestmark = pytest.mark.functional

TOKEN = "model-test-token"
CONTROL = "/ng-control/v1/checkpoint"
ADD_TOOL = {
    "type": "function",
    "name": "add",
    "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
}


def gym_config(policy_base_url: str) -> dict:
    return {
        "checkpoint": {"enabled": True, "control_auth_token": TOKEN},
        "policy_base_url": policy_base_url,
        "policy_model_name": "test-policy",
        "policy_api_key": "backend-key",
        "policy_model": {"responses_api_models": {"vllm_model": {"request_timeout_s": 30}}},
    }


@pytest.fixture(scope="module")
def backend():
    with ScriptedBackend().start() as b:
        yield b


@pytest.fixture(scope="module")
def model_url(backend):
    with GymDeployment.start(gym_config(backend.base_url)) as dep:
        yield dep.url("policy_model")


@pytest.fixture(autouse=True)
def fresh_state(backend, model_url):
    backend.reset()
    yield
    backend.reset()  # releases anything a failed test left held
    _resume_if_active(model_url)  # so one failed test does not leave the gate closed for the next


def _resume_if_active(model_url: str) -> None:
    def call(method, op, body=None):
        req = urllib.request.Request(
            f"{model_url}{CONTROL}/{op}",
            data=None if body is None else json.dumps(body).encode(),
            method=method,
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())

    status = call("GET", "status")
    if status["checkpoint_id"] is not None:
        call("POST", "resume", {"checkpoint_id": status["checkpoint_id"], "deadline_ts": time.time() + 10})


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


try:
    from openai.types.responses import Response as OpenAIResponse
except ImportError:  # the openai client is a test extra; without it the shape check is skipped
    OpenAIResponse = None


async def post(http, url, body, headers=None):
    async with http.post(url, json=body, headers=headers) as resp:
        status, reply = resp.status, await resp.json()
    if status == 200 and "/v1/responses" in url and OpenAIResponse is not None:
        OpenAIResponse.model_validate(reply)  # every reply passes the openai client's own type
    return status, reply


async def control(http, model_url, op, **body):
    headers = {"Authorization": f"Bearer {TOKEN}"}
    if op == "status":
        async with http.get(f"{model_url}{CONTROL}/status", headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()
    body.setdefault("deadline_ts", time.time() + 20)
    status, reply = await post(http, f"{model_url}{CONTROL}/{op}", body, headers)
    assert status == 200, reply
    return reply


async def until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_rollout_call_maps_reply_and_token_ids(backend, model_url, http):
    user = "What is 2+2?"
    backend.set_plans({user: [{"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 2}}]}, {"content": "4"}]})
    url = f"{model_url}/ng-rollout/fr1/v1/responses"

    status, first = await post(http, url, {"input": user, "tools": [ADD_TOOL], "temperature": 0.0})
    assert status == 200, first
    assert first["object"] == "response" and first["incomplete_details"] is None
    (call,) = first["output"]
    assert call["type"] == "function_call" and call["name"] == "add"
    assert json.loads(call["arguments"]) == {"a": 2, "b": 2}
    generated = list(("add" + call["arguments"]).encode())
    assert call["prompt_token_ids"] == list(f"<user>{user}".encode())
    assert call["generation_token_ids"] == generated
    assert call["generation_log_probs"] == [fake_logprob(t) for t in generated]
    assert call["weight_version"] == 0
    assert first["usage"]["output_tokens"] == len(generated)

    items = [{"role": "user", "content": user}, call, {"type": "function_call_output", "call_id": call["call_id"], "output": "4"}]
    status, second = await post(http, url, {"input": items, "tools": [ADD_TOOL]})
    assert status == 200, second
    (message,) = second["output"]
    assert message["content"] == [{"type": "output_text", "text": "4", "annotations": []}]
    assert message["generation_token_ids"] == list(b"4")

    calls = backend.calls(user)
    assert [c["turn"] for c in calls] == [0, 1]
    assert {c["model"] for c in calls} == {"test-policy"}
    assert {c["authorization"] for c in calls} == {"Bearer backend-key"}

    status, cut = await post(http, f"{model_url}/v1/responses", {"input": user, "max_output_tokens": 2})
    assert status == 200 and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut["output"][-1]["generation_token_ids"] == list(b"ad")


def assert_openai_error(reply, *, code, param=None, fragment=""):
    """The OpenAI error shape: exactly message, type, param, code."""
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"}, reply
    assert error["code"] == code and error["param"] == param, reply
    assert isinstance(error["type"], str) and fragment in error["message"], reply


async def test_bad_requests_are_400_naming_the_field(model_url, http):
    status, reply = await post(http, f"{model_url}/v1/responses", {"input": [{"role": "robot", "content": "x"}]})
    assert status == 400
    assert_openai_error(reply, code="invalid_request", param="input[0].role", fragment="input[0].role")
    assert reply["error"]["type"] == "invalid_request_error"
    status, reply = await post(http, f"{model_url}/v1/responses", {"tools": []})
    assert status == 400
    assert_openai_error(reply, code="invalid_request", param="input", fragment="input")
    status, reply = await post(http, f"{model_url}/v1/responses", {"input": "x", "max_output_tokens": 0})
    assert status == 400
    assert_openai_error(reply, code="invalid_request", param="max_output_tokens")
    status, reply = await post(http, f"{model_url}/ng-rollout/-bad/v1/responses", {"input": "x"})
    assert status == 400
    assert_openai_error(reply, code="invalid_request", fragment="capture key")
    async with http.post(f"{model_url}/v1/responses", data=b"{not json", headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400 and r.headers["x-should-retry"] == "false"
        assert_openai_error(await r.json(), code="invalid_request", fragment="not valid JSON")


async def test_oversized_body_is_413_in_the_openai_shape(model_url, http):
    from gym_patches.server_utils import MAX_REQUEST_BODY_BYTES

    big = b'{"input": "' + b"x" * MAX_REQUEST_BODY_BYTES + b'"}'
    async with http.post(f"{model_url}/v1/responses", data=big, headers={"Content-Type": "application/json"}) as r:
        status, reply = r.status, await r.json()
    assert status == 413
    assert_openai_error(reply, code="payload_too_large", fragment=str(MAX_REQUEST_BODY_BYTES))
    status, reply = await post(http, f"{model_url}/v1/responses", {"input": "still serving"})
    assert status == 200, reply


def test_unreachable_backend_is_a_502_naming_it():
    dead = f"http://127.0.0.1:{free_port()}/v1"
    with GymDeployment.start(gym_config(dead)) as dep:
        async def call():
            async with aiohttp.ClientSession() as session:
                return await post(session, f"{dep.url('policy_model')}/ng-rollout/x1/v1/responses", {"input": "hi"})

        status, reply = asyncio.run(call())
    assert status == 502
    assert_openai_error(reply, code="backend_error", fragment=f"{dead}/chat/completions")
    assert reply["error"]["type"] == "server_error"


async def test_prepare_holds_finished_reply_until_resume(backend, model_url, http, tmp_path):
    user, late_user = "Hold me", "Late comer"
    backend.set_plans({user: [{"content": "held answer"}], late_user: [{"content": "late answer"}]})
    backend.hold(user, 0)
    held = asyncio.create_task(post(http, f"{model_url}/ng-rollout/fh1/v1/responses", {"input": user}))
    await asyncio.to_thread(backend.wait_for_held, user, 0)

    prepared = await control(http, model_url, "prepare", checkpoint_id="ck-hold")
    assert prepared["phase"] == "prepared", "a call still generating must not block prepare"
    assert prepared["report"]["counts"]["inflight"] == 1
    status = await control(http, model_url, "status")
    assert status["kind"] == "model" and status["accepting"] is False

    assert backend.release(user, 0)
    await until(lambda: _count(http, model_url, "held", 1))
    assert backend.calls(user), "the backend has answered"
    late = asyncio.create_task(post(http, f"{model_url}/ng-rollout/fh2/v1/responses", {"input": late_user}))
    await until(lambda: _count(http, model_url, "waiting", 1))
    await asyncio.sleep(0.3)
    assert not held.done() and not late.done(), "nothing is delivered while prepared"
    assert backend.calls(late_user) == [], "a call arriving while closed waits before the backend"

    committed = await control(http, model_url, "commit", checkpoint_id="ck-hold", checkpoint_dir=str(tmp_path / "a"),
                              episode_ids=[{"rollout_id": "fh1"}])
    assert committed["episode_ids"] == ["fh1"] and committed["manifest"]["record_count"] == 1

    await control(http, model_url, "resume", checkpoint_id="ck-hold")
    status_code, reply = await asyncio.wait_for(held, 5)
    assert status_code == 200 and reply["output"][0]["content"][0]["text"] == "held answer"
    status_code, reply = await asyncio.wait_for(late, 5)
    assert status_code == 200 and reply["output"][0]["content"][0]["text"] == "late answer"
    assert (await control(http, model_url, "status"))["accepting"] is True

    # The delivered reply now counts; restore installs it under the next attempt.
    await control(http, model_url, "prepare", checkpoint_id="ck-after")
    await control(http, model_url, "commit", checkpoint_id="ck-after", checkpoint_dir=str(tmp_path / "b"),
                  episode_ids=[{"rollout_id": "fh1"}])
    await control(http, model_url, "resume", checkpoint_id="ck-after")
    records = (tmp_path / "b" / "gym" / "model" / "policy_model").glob("records-*.jsonl")
    (path,) = list(records)
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"episode_id": {"rollout_id": "fh1", "attempt": 0}, "delivered_calls": 1}
    ]
    restored = await control(http, model_url, "restore", checkpoint_id="ck-restore", checkpoint_dir=str(tmp_path / "b"),
                             episode_ids=[{"rollout_id": "fh1"}], source_checkpoint_id="ck-after")
    assert restored["restored"] == ["fh1-a1"]
    await control(http, model_url, "resume", checkpoint_id="ck-restore")
    status_code, reply = await post(http, f"{model_url}/ng-rollout/fh1/v1/responses", {"input": user})
    assert status_code == 409 and reply["error"]["code"] == "stale_attempt"
    status_code, reply = await post(http, f"{model_url}/ng-rollout/fh1-a1/v1/responses", {"input": user})
    assert status_code == 200, reply


async def test_each_tracked_call_carries_its_index_and_a_restored_episode_counts_on(backend, model_url, http,
                                                                                    tmp_path):
    """``X-NG-Call-Index``: the replies the episode was delivered when the call was made; a restored episode
    (the next attempt) counts on from its record, so the same call keeps its index; untracked calls have none."""
    user = "Count my calls"
    backend.set_plans({user: [{"content": "one"}, {"content": "two"}, {"content": "three"}]})
    url = f"{model_url}/ng-rollout/fi1/v1/responses"
    for _ in range(2):
        status, reply = await post(http, url, {"input": user})
        assert status == 200, reply
    status, _ = await post(http, f"{model_url}/v1/responses", {"input": user})
    assert status == 200
    await control(http, model_url, "prepare", checkpoint_id="ck-index")
    await control(http, model_url, "commit", checkpoint_id="ck-index", checkpoint_dir=str(tmp_path),
                  episode_ids=[{"rollout_id": "fi1"}])
    await control(http, model_url, "resume", checkpoint_id="ck-index")
    restored = await control(http, model_url, "restore", checkpoint_id="ck-index-restore",
                             checkpoint_dir=str(tmp_path), episode_ids=[{"rollout_id": "fi1"}],
                             source_checkpoint_id="ck-index")
    assert restored["restored"] == ["fi1-a1"]
    await control(http, model_url, "resume", checkpoint_id="ck-index-restore")
    status, reply = await post(http, f"{model_url}/ng-rollout/fi1-a1/v1/responses", {"input": user})
    assert status == 200, reply
    calls = backend.calls(user)
    assert [c["call_index"] for c in calls] == ["0", "1", None, "2"]
    assert [c["call_id"].rsplit(".", 1)[0] if c["call_id"] else None for c in calls] == ["fi1", "fi1", None, "fi1-a1"]


async def test_retire_cancels_an_inflight_call(backend, model_url, http):
    user = "Retire me"
    backend.set_plans({user: [{"content": "never seen"}]})
    backend.hold(user, 0)
    call = asyncio.create_task(post(http, f"{model_url}/ng-rollout/fr9/v1/responses", {"input": user}))
    await asyncio.to_thread(backend.wait_for_held, user, 0)
    reply = await control(http, model_url, "retire", checkpoint_id="ck-retire", episode_ids=[{"rollout_id": "fr9"}])
    assert reply["retired"] == ["fr9"]
    status, body = await asyncio.wait_for(call, 5)
    assert status == 409 and body["error"]["code"] == "stale_attempt" and "fr9" in body["error"]["message"]
    status, body = await post(http, f"{model_url}/ng-rollout/fr9/v1/responses", {"input": user})
    assert status == 409 and body["error"]["code"] == "stale_attempt"
    await control(http, model_url, "resume", checkpoint_id="ck-retire")


async def _count(http, model_url, name, expected):
    return (await control(http, model_url, "status"))["report"]["counts"].get(name) == expected


async def test_control_routes_refuse_oversized_bodies_and_past_deadlines(model_url, http, tmp_path):
    """Items of the control protocol on a real server process: 413 over the body cap,
    422 naming deadline_ts for a deadline already past; neither changes the phase."""
    from gym_patches.checkpoint.control import MAX_CONTROL_BODY_BYTES

    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    prepared = await control(http, model_url, "prepare", checkpoint_id="ck-edge")
    assert prepared["phase"] == "prepared"
    lease = (await control(http, model_url, "status"))["lease_expires_at"]

    big = json.dumps({"checkpoint_id": "ck-edge", "deadline_ts": time.time() + 20,
                      "checkpoint_dir": "/" + "d" * MAX_CONTROL_BODY_BYTES}).encode()
    async with http.post(f"{model_url}{CONTROL}/commit", data=big, headers=headers) as resp:
        status, reply = resp.status, await resp.json()
    assert status == 413 and reply == {"error": {"code": "payload_too_large", "detail": reply["error"]["detail"]}}
    assert str(MAX_CONTROL_BODY_BYTES) in reply["error"]["detail"]

    for op, extra in (("renew", {}), ("commit", {"checkpoint_dir": str(tmp_path)}), ("prepare", {})):
        body = {"checkpoint_id": "ck-edge", "deadline_ts": time.time() - 1, **extra}
        status, reply = await post(http, f"{model_url}{CONTROL}/{op}", body, headers)
        assert status == 422 and reply["error"]["code"] == "invalid_request", (op, reply)
        assert "deadline_ts" in reply["error"]["detail"], (op, reply)

    after = await control(http, model_url, "status")
    assert after["phase"] == "prepared" and after["checkpoint_id"] == "ck-edge" and after["lease_expires_at"] == lease
    assert not (tmp_path / "gym").exists()
    resumed = await post(http, f"{model_url}{CONTROL}/resume", {"checkpoint_id": "ck-edge",
                                                                "deadline_ts": time.time() - 1}, headers)
    assert resumed == (200, {"phase": "idle", "idempotent": False})


def test_a_call_is_sent_again_until_the_backend_is_back_and_the_caller_gets_its_reply():
    """``policy_unreachable_retry_s``: the backend's port is closed (a generation worker being restarted) when
    the real ``openai`` client calls; the backend comes up 1.5 s later on the same port and gets the call
    once, under the same call id and marked as sent again; the client sees a slower reply, not an error."""
    import threading

    import openai

    port = free_port()
    cfg = gym_config(f"http://127.0.0.1:{port}/v1")
    cfg["policy_unreachable_retry_s"] = 30
    with GymDeployment.start(cfg) as dep:
        client = openai.OpenAI(base_url=f"{dep.url('policy_model')}/ng-rollout/rc1/v1", api_key="k", max_retries=0)
        got: dict = {}
        caller = threading.Thread(target=lambda: got.update(reply=client.responses.create(model="p", input="hi")))
        started = time.monotonic()
        caller.start()
        time.sleep(1.5)
        with ScriptedBackend().start(port=port) as backend:
            caller.join(30)
            calls = backend.calls()
    assert "reply" in got and got["reply"].output_text, got
    assert time.monotonic() - started >= 1.5
    assert len(calls) == 1, calls
    assert calls[0]["call_id"].startswith("rc1.") and int(calls[0]["resend"]) >= 1, calls


def test_a_backend_still_unreachable_after_the_bound_is_a_502_naming_it():
    dead = f"http://127.0.0.1:{free_port()}/v1"
    cfg = gym_config(dead)
    cfg["policy_unreachable_retry_s"] = 1.0
    with GymDeployment.start(cfg) as dep:
        async def call():
            async with aiohttp.ClientSession() as session:
                return await post(session, f"{dep.url('policy_model')}/ng-rollout/x2/v1/responses", {"input": "hi"})

        started = time.monotonic()
        status, reply = asyncio.run(call())
    assert status == 502 and time.monotonic() - started >= 1.0
    assert_openai_error(reply, code="backend_error", fragment="policy_unreachable_retry_s")
