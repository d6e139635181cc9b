"""Responses API <-> chat-completions mapping of the policy model server."""

from __future__ import annotations

import json

import pytest

from gym_patches.responses_api_models.vllm_model.converter import (
    BackendReplyError,
    ConversionError,
    chat_to_responses,
    responses_to_chat,
)
from gym_patches.wire_models import ResponsesReply, ResponsesRequest

TOOL = {
    "type": "function",
    "name": "lookup",
    "description": "Look a name up.",
    "parameters": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
    "strict": True,
}


def to_chat(**fields):
    return responses_to_chat(ResponsesRequest(**fields), model="policy-x")


def chat_reply(content=None, tool_calls=(), finish="stop", **extra):
    message = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = [
            {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, (n, a) in enumerate(tool_calls)
        ]
    return {
        "id": "chatcmpl-1",
        "model": "backend-model",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
        **extra,
    }


TOKENS = {
    "prompt_token_ids": [1, 2, 3],
    "generation_token_ids": [4, 5],
    "generation_log_probs": [-0.5, -0.25],
    "weight_version": 3,
}


def test_string_input_and_instructions_fold_into_one_system_message():
    body = to_chat(
        input=[{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}],
        instructions="You are a helper.",
        temperature=0.3,
        max_output_tokens=64,
    )
    assert body["model"] == "policy-x"
    assert body["messages"] == [
        {"role": "system", "content": "You are a helper.\n\nBe terse."},
        {"role": "user", "content": "hi"},
    ]
    assert body["temperature"] == 0.3 and body["max_tokens"] == 64
    assert body["logprobs"] is True
    plain = to_chat(input="hello", instructions="sys")
    assert plain["messages"] == [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello"}]
    assert "temperature" not in plain and "max_tokens" not in plain


def test_items_map_to_messages_and_consecutive_calls_merge():
    body = to_chat(
        input=[
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
            {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": '{"name": "x"}'},
            {"type": "function_call", "call_id": "c2", "name": "lookup", "arguments": '{"name": "y"}',
             "generation_token_ids": [9], "weight_version": 0},
            {"type": "function_call_output", "call_id": "c1", "output": "X"},
            {"type": "function_call_output", "call_id": "c2", "output": "Y"},
            {"type": "function_call", "call_id": "c3", "name": "lookup", "arguments": "{}"},
        ],
        tools=[TOOL],
    )
    msgs = body["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "tool", "assistant"]
    assert msgs[1]["content"] == "ab"
    assert msgs[2]["content"] == "Let me look."
    assert [c["id"] for c in msgs[2]["tool_calls"]] == ["c1", "c2"]
    assert msgs[2]["tool_calls"][1] == {
        "id": "c2", "type": "function", "function": {"name": "lookup", "arguments": '{"name": "y"}'}
    }
    assert msgs[3] == {"role": "tool", "tool_call_id": "c1", "content": "X"}
    assert msgs[5] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c3", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    ]}
    assert body["tools"] == [{
        "type": "function",
        "function": {"name": "lookup", "description": "Look a name up.", "parameters": TOOL["parameters"], "strict": True},
    }]


def test_tool_choice_and_passthrough_fields():
    body = to_chat(input="q", tool_choice={"type": "function", "name": "lookup"}, top_p=0.9, parallel_tool_calls=False)
    assert body["tool_choice"] == {"type": "function", "function": {"name": "lookup"}}
    assert body["top_p"] == 0.9 and body["parallel_tool_calls"] is False
    no_tokens = responses_to_chat(ResponsesRequest(input="q"), model="m", return_token_ids=False)
    assert "logprobs" not in no_tokens


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "url": "u"}]}]}, "input[0].content[0].type"),
        ({"input": [{"role": "user", "content": 5}]}, "input[0].content"),
        ({"input": [{"role": "user", "content": "x"}, {"type": "function_call", "name": "f", "arguments": "{}"}]},
         "input[1].call_id"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}]}, "input[0].arguments"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, "input[0].output"),
        ({"input": [{"content": "no role"}]}, "input[0].type"),
        ({"input": "q", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "q", "tools": [{"type": "function", "description": "nameless"}]}, "tools[0].name"),
        ({"input": "q", "tools": [{"type": "function", "name": "f", "parameters": "x"}]}, "tools[0].parameters"),
        ({"input": "q", "tool_choice": "sometimes"}, "tool_choice"),
        ({"input": "q", "stream": True}, "stream"),
        ({"input": []}, "input"),
    ],
)
def test_bad_requests_name_the_field(fields, named):
    with pytest.raises(ConversionError) as info:
        to_chat(**fields)
    assert info.value.field == named
    assert named in str(info.value)


def test_reply_with_text_and_tool_calls_round_trips_to_one_assistant_message():
    reply = chat_to_responses(
        chat_reply("Checking.", [("lookup", {"name": "x"}), ("lookup", {"name": "y"})], finish="tool_calls", **TOKENS),
        model="policy-x",
        response_id="resp_1",
    )
    ResponsesReply.model_validate(reply)
    assert reply["id"] == "resp_1" and reply["object"] == "response" and reply["model"] == "backend-model"
    assert reply["incomplete_details"] is None
    assert reply["usage"] == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                              "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 0},
                              "total_tokens": 10}
    out = reply["output"]
    assert [i["type"] for i in out] == ["message", "function_call", "function_call"]
    assert out[0]["content"] == [{"type": "output_text", "text": "Checking.", "annotations": []}]
    assert out[0]["id"].startswith("msg_") and out[0]["status"] == "completed"
    assert out[1]["id"].startswith("fc_") and out[1]["id"] != out[2]["id"] and out[1]["status"] == "completed"
    assert out[1]["call_id"] == "call_0" and json.loads(out[2]["arguments"]) == {"name": "y"}
    # Token info rides on the LAST item only.
    assert {k: out[-1][k] for k in TOKENS} == TOKENS
    assert not any(k in out[0] or k in out[1] for k in TOKENS)
    # Feeding the items back yields one assistant message with both calls.
    body = to_chat(input=[{"role": "user", "content": "q"}, *out])
    assert len(body["messages"]) == 2
    assistant = body["messages"][1]
    assert assistant["content"] == "Checking." and [c["id"] for c in assistant["tool_calls"]] == ["call_0", "call_1"]


def test_final_text_length_and_token_options():
    final = chat_to_responses(chat_reply("42", **TOKENS), model="m")
    (item,) = final["output"]
    assert item == {"id": item["id"], "type": "message", "role": "assistant", "status": "completed",
                    "content": [{"type": "output_text", "text": "42", "annotations": []}], **TOKENS}
    assert final["status"] == "completed"
    cut = chat_to_responses(chat_reply("4", finish="length"), model="m")
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut["status"] == "incomplete" and cut["output"][0]["status"] == "incomplete"
    empty = chat_to_responses(chat_reply(None, **TOKENS), model="m")
    assert empty["output"][0]["content"][0]["text"] == "" and empty["output"][0]["weight_version"] == 3
    stripped = chat_to_responses(chat_reply("42", **TOKENS), model="m", keep_token_ids=False)
    assert not any(k in stripped["output"][0] for k in TOKENS)
    # Choice-level token ids (vLLM style) are found too.
    reply = chat_reply("x")
    reply["choices"][0]["generation_token_ids"] = [8]
    assert chat_to_responses(reply, model="m")["output"][-1]["generation_token_ids"] == [8]


@pytest.mark.parametrize(
    "reply, fragment",
    [
        ([], "JSON object"),
        ({"choices": []}, "no choices"),
        ({"choices": [{"finish_reason": "stop"}]}, "message is missing"),
        (chat_reply("x", generation_token_ids=[1, 2], generation_log_probs=[-1.0]), "differ in length"),
        (chat_reply("x", generation_token_ids=["a"]), "generation_token_ids"),
        (chat_reply("x", weight_version="v1"), "weight_version"),
        ({"choices": [{"message": {"content": None, "tool_calls": [{"id": "c"}]}}]}, "has no function"),
    ],
)
def test_bad_backend_replies_are_reported(reply, fragment):
    with pytest.raises(BackendReplyError, match=fragment):
        chat_to_responses(reply, model="m")


# -- the reply against the openai client's own schema ------------------------------------------------
openai_responses = pytest.importorskip("openai.types.responses")


@pytest.mark.parametrize(
    "chat, request_fields",
    [
        (chat_reply("42", **TOKENS), {"input": "q"}),
        (chat_reply(None, [("lookup", {"name": "x"})], finish="tool_calls", **TOKENS),
         {"input": "q", "tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False,
          "instructions": "Be brief.", "temperature": 0.5, "top_p": 0.9, "max_output_tokens": 8,
          "metadata": {"run": "a"}}),
        (chat_reply("Checking.", [("lookup", {"name": "x"})], finish="length"),
         {"input": "q", "tools": [{"type": "function", "name": "lookup"}],
          "tool_choice": {"type": "function", "name": "lookup"}}),
    ],
)
def test_replies_validate_against_the_openai_response_type(chat, request_fields):
    request = ResponsesRequest(**request_fields)
    reply = chat_to_responses(chat, model="m", request=request, created_at=1_700_000_000)
    parsed = openai_responses.Response.model_validate(reply)  # strict about required fields
    assert parsed.created_at == 1_700_000_000 and parsed.id == reply["id"]
    assert all(item.id for item in parsed.output)
    assert parsed.usage is not None and parsed.usage.input_tokens_details.cached_tokens == 0
    assert parsed.usage.output_tokens_details.reasoning_tokens == 0
    choice = parsed.tool_choice
    assert (choice if isinstance(choice, str) else choice.model_dump(exclude_none=True)) == request_fields.get(
        "tool_choice", "auto")
    assert parsed.parallel_tool_calls is request_fields.get("parallel_tool_calls", True)
    assert [t.name for t in parsed.tools] == [t["name"] for t in request_fields.get("tools", [])]
    assert parsed.instructions == request_fields.get("instructions")
    assert parsed.temperature == request_fields.get("temperature") and parsed.top_p == request_fields.get("top_p")
    assert parsed.metadata == request_fields.get("metadata", {})
    # Token info survives the client's parsing as extra fields on the last item.
    if "generation_token_ids" in chat:
        assert parsed.output[-1].model_extra["generation_token_ids"] == TOKENS["generation_token_ids"]


def test_reply_without_the_new_fields_is_what_the_openai_type_rejects():
    """The check above can fail: a reply missing what the schema requires is refused."""
    reply = chat_to_responses(chat_reply("42"), model="m")
    for key in ("created_at", "tools", "tool_choice", "parallel_tool_calls"):
        broken = {k: v for k, v in reply.items() if k != key}
        with pytest.raises(ValueError):
            openai_responses.Response.model_validate(broken)
    broken = json.loads(json.dumps(reply))
    del broken["output"][0]["content"][0]["annotations"]
    with pytest.raises(ValueError):
        openai_responses.Response.model_validate(broken)


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"input": "q", "top_p": "high"}, "top_p"),
        ({"input": "q", "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"input": "q", "metadata": {"a": 1}}, "metadata"),
    ],
)
def test_echoed_fields_are_type_checked(fields, named):
    with pytest.raises(ConversionError) as info:
        to_chat(**fields)
    assert info.value.field == named
