"""Responses API <-> chat-completions mapping for the policy model server.

Agents speak the Responses API; the policy backend (vLLM, the RL generation
worker, the scripted test backend) speaks OpenAI chat completions. Training
needs the backend's token ids and logprobs, so those ride along on the last
output item of the Responses reply.

Request errors raise :class:`ConversionError` naming the field (the server
answers 400 in the OpenAI error shape); a malformed backend reply raises
:class:`BackendReplyError` (the server answers 502).

Replies carry every field the Responses schema requires (``created_at``,
``tools``, ``tool_choice``, ``parallel_tool_calls``, usage details, item ids and
statuses, text ``annotations``), so the ``openai`` client's own types accept them.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Any

from pydantic import ValidationError

from gym_patches.checkpoint.cuts import PrefixContinuation
from gym_patches.wire_models import (
    InputTokensDetails,
    Item,
    OutputTokensDetails,
    ResponsesReply,
    ResponsesRequest,
    ResponseUsage,
)

# Backend extensions passed through to the last output item, for training.
TOKEN_FIELDS: tuple[str, ...] = ("prompt_token_ids", "generation_token_ids", "generation_log_probs", "weight_version",
                                  "prefix_continuation")
MESSAGE_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
TEXT_PART_TYPES = frozenset({"input_text", "output_text", "text"})
# Request fields forwarded unchanged when present (others are Responses-only and dropped).
PASSTHROUGH_FIELDS: tuple[str, ...] = ("top_p", "parallel_tool_calls")


class ConversionError(ValueError):
    """A Responses request we cannot map; ``field`` is its dotted path."""

    def __init__(self, field: str, detail: str):
        super().__init__(f"{field}: {detail}")
        self.field = field
        self.detail = f"{field}: {detail}"


class BackendReplyError(ValueError):
    """The chat-completions backend answered with something we cannot map."""


# -- request -----------------------------------------------------------------
def responses_to_chat(request: ResponsesRequest, *, model: str, return_token_ids: bool = True) -> dict[str, Any]:
    """The chat-completions body for ``request``, addressed to ``model``."""
    extra = request.model_extra or {}
    if extra.get("stream"):
        raise ConversionError("stream", "streaming replies are not supported by this model server")
    messages = _messages(request.input)
    if request.instructions:
        if messages and messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": f"{request.instructions}\n\n{messages[0]['content']}"}
        else:
            messages.insert(0, {"role": "system", "content": request.instructions})
    if not messages:
        raise ConversionError("input", "must hold at least one item")
    body: dict[str, Any] = {"model": model, "messages": messages}
    if request.tools:
        body["tools"] = [_tool(i, t) for i, t in enumerate(request.tools)]
    if request.temperature is not None:
        body["temperature"] = request.temperature
    if request.max_output_tokens is not None:
        body["max_tokens"] = request.max_output_tokens
    _check_echoed_fields(extra)
    for key in PASSTHROUGH_FIELDS:
        if extra.get(key) is not None:
            body[key] = extra[key]
    if extra.get("tool_choice") is not None:
        body["tool_choice"] = _tool_choice(extra["tool_choice"])
    if return_token_ids:
        body["logprobs"] = True
    return body


def _check_echoed_fields(extra: dict[str, Any]) -> None:
    """Types of the optional fields the reply echoes (ranges are the backend's call)."""
    top_p = extra.get("top_p")
    if top_p is not None and not _is_number(top_p):
        raise ConversionError("top_p", "must be a number")
    parallel = extra.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ConversionError("parallel_tool_calls", "must be a boolean")
    metadata = extra.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise ConversionError("metadata", "must be an object of string values")


def _messages(input_: str | list[Item]) -> list[dict[str, Any]]:
    if isinstance(input_, str):
        return [{"role": "user", "content": input_}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(input_):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ConversionError(where, f"must be an object, got {type(item).__name__}")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            messages.append(_message(where, item))
        elif kind == "function_call":
            _append_tool_call(messages, where, item)
        elif kind == "function_call_output":
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _str_field(where, item, "call_id"),
                    "content": _output_text(where, item),
                }
            )
        elif kind is None:
            raise ConversionError(f"{where}.type", "missing (and no 'role' to infer a message)")
        else:
            raise ConversionError(
                f"{where}.type", f"unsupported item type {kind!r} (expected message, function_call, function_call_output)"
            )
    return messages


def _message(where: str, item: Item) -> dict[str, Any]:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise ConversionError(f"{where}.role", f"must be one of {sorted(MESSAGE_ROLES)}, got {role!r}")
    return {"role": MESSAGE_ROLES[role], "content": _content_text(where, item.get("content"))}


def _content_text(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ConversionError(f"{where}.content", f"must be a string or a list of text parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PART_TYPES:
            got = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ConversionError(f"{where}.content[{j}].type", f"must be one of {sorted(TEXT_PART_TYPES)}, got {got!r}")
        text = part.get("text")
        if not isinstance(text, str):
            raise ConversionError(f"{where}.content[{j}].text", "must be a string")
        texts.append(text)
    return "".join(texts)


def _append_tool_call(messages: list[dict[str, Any]], where: str, item: Item) -> None:
    """A function_call joins the assistant message right before it (same turn),
    so one model reply maps back to exactly one assistant message."""
    arguments = item.get("arguments")
    if not isinstance(arguments, str):
        raise ConversionError(f"{where}.arguments", "must be a JSON string")
    call = {
        "id": _str_field(where, item, "call_id"),
        "type": "function",
        "function": {"name": _str_field(where, item, "name"), "arguments": arguments},
    }
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
        if last.get("content") == "":
            last["content"] = None
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _output_text(where: str, item: Item) -> str:
    output = item.get("output")
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return _content_text(f"{where}.output", output)
    raise ConversionError(f"{where}.output", "must be a string")


def _str_field(where: str, item: Item, key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise ConversionError(f"{where}.{key}", "must be a non-empty string")
    return value


def _tool(index: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{index}]"
    if not isinstance(tool, dict):
        raise ConversionError(where, "must be an object")
    if tool.get("type", "function") != "function":
        raise ConversionError(f"{where}.type", f"only 'function' tools are supported, got {tool.get('type')!r}")
    function: dict[str, Any] = {"name": _str_field(where, tool, "name")}
    if tool.get("description") is not None:
        if not isinstance(tool["description"], str):
            raise ConversionError(f"{where}.description", "must be a string")
        function["description"] = tool["description"]
    parameters = tool.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise ConversionError(f"{where}.parameters", "must be a JSON schema object")
    function["parameters"] = parameters
    if tool.get("strict") is not None:
        function["strict"] = bool(tool["strict"])
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ConversionError("tool_choice", "must be 'auto', 'none', 'required' or {type: 'function', name}")


# -- reply -------------------------------------------------------------------
def chat_to_responses(
    reply: Any,
    *,
    model: str,
    keep_token_ids: bool = True,
    response_id: str | None = None,
    request: ResponsesRequest | None = None,
    created_at: int | None = None,
) -> dict[str, Any]:
    """The Responses reply for one chat completion (first choice).

    ``request`` (the Responses request that was mapped) supplies the fields a
    response echoes: instructions, tools, tool_choice, sampling settings.
    """
    choice, message, content = _first_choice(reply)
    incomplete = _incomplete_details(choice.get("finish_reason"))
    status = "incomplete" if incomplete else "completed"
    output = _output_items(message, content, status)
    if keep_token_ids:
        output[-1].update(_token_info(reply, choice, message))
    out = ResponsesReply(
        id=response_id or f"resp_{uuid.uuid4().hex}",
        created_at=int(time.time()) if created_at is None else created_at,
        status=status,
        model=reply.get("model") if isinstance(reply.get("model"), str) else model,
        output=output,
        incomplete_details=incomplete,
        usage=_usage(reply.get("usage")),
        **_echoed(request),
    )
    return out.model_dump(mode="json")


def _first_choice(reply: Any) -> tuple[dict[str, Any], dict[str, Any], str | None]:
    """The first choice, its message and its text, checked before anything is built from them.

    Split out of ``chat_to_responses`` so the shape checks of a backend reply read in one place.
    """
    if not isinstance(reply, dict):
        raise BackendReplyError(f"reply must be a JSON object, got {type(reply).__name__}")
    choices = reply.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise BackendReplyError("reply has no choices")
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, dict):
        raise BackendReplyError("choices[0].message is missing")
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise BackendReplyError("choices[0].message.content must be a string or null")
    return choice, message, content


def _incomplete_details(finish: Any) -> dict[str, str] | None:
    """Why a reply stopped early, in Responses terms (None when it finished on its own)."""
    if finish == "length":
        return {"reason": "max_output_tokens"}
    if finish == "content_filter":
        return {"reason": "content_filter"}
    return None


def _output_items(message: dict[str, Any], content: str | None, status: str) -> list[Item]:
    """The reply's output items: the text message (always one item when there are no tool calls,
    so the token info has somewhere to go), then one function_call item per tool call."""
    output: list[Item] = []
    tool_calls = message.get("tool_calls") or []
    if not isinstance(tool_calls, list):
        raise BackendReplyError("choices[0].message.tool_calls must be a list")
    if content or not tool_calls:  # always at least one item to carry the token info
        output.append(
            {
                "id": f"msg_{uuid.uuid4().hex}",
                "type": "message",
                "role": "assistant",
                "status": status,
                "content": [{"type": "output_text", "text": content or "", "annotations": []}],
            }
        )
    for j, call in enumerate(tool_calls):
        output.append(_function_call_item(j, call))
    return output


def _echoed(request: ResponsesRequest | None) -> dict[str, Any]:
    """The request settings a Responses reply repeats back."""
    if request is None:
        return {}
    extra = request.model_extra or {}
    tools = []
    for tool in request.tools:
        echoed = {
            "type": "function",
            "name": tool.get("name"),
            "description": tool.get("description"),
            "parameters": tool.get("parameters") or {"type": "object", "properties": {}},
            "strict": tool.get("strict"),
        }
        tools.append(echoed)
    fields: dict[str, Any] = {
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": extra.get("top_p"),
        "tools": tools,
        "metadata": extra.get("metadata") or {},
    }
    if extra.get("tool_choice") is not None:
        fields["tool_choice"] = extra["tool_choice"]
    if extra.get("parallel_tool_calls") is not None:
        fields["parallel_tool_calls"] = extra["parallel_tool_calls"]
    return fields


def _usage(usage: Any) -> ResponseUsage:
    usage = usage if isinstance(usage, dict) else {}
    prompt, completion = _count(usage, "prompt_tokens"), _count(usage, "completion_tokens")
    prompt_details = usage.get("prompt_tokens_details")
    completion_details = usage.get("completion_tokens_details")
    return ResponseUsage(
        input_tokens=prompt,
        input_tokens_details=InputTokensDetails(
            cached_tokens=_count(prompt_details, "cached_tokens") if isinstance(prompt_details, dict) else 0
        ),
        output_tokens=completion,
        output_tokens_details=OutputTokensDetails(
            reasoning_tokens=(
                _count(completion_details, "reasoning_tokens") if isinstance(completion_details, dict) else 0
            )
        ),
        total_tokens=_count(usage, "total_tokens") or prompt + completion,
    )


def _function_call_item(index: int, call: Any) -> Item:
    where = f"choices[0].message.tool_calls[{index}]"
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise BackendReplyError(f"{where} has no function")
    name = call["function"].get("name")
    if not isinstance(name, str) or not name:
        raise BackendReplyError(f"{where}.function.name is missing")
    arguments = call["function"].get("arguments", "{}")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    call_id = call.get("id") if isinstance(call.get("id"), str) and call.get("id") else f"call_{uuid.uuid4().hex[:24]}"
    return {
        "id": f"fc_{uuid.uuid4().hex}",
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


def _token_info(*sources: dict[str, Any]) -> dict[str, Any]:
    """The token extensions, from the reply top level (or the choice/message)."""
    info: dict[str, Any] = {}
    for key in TOKEN_FIELDS:
        value = next((s[key] for s in sources if s.get(key) is not None), None)
        if value is None:
            continue
        value = _checked_token_field(key, value)
        info[key] = value
    gen, lp = info.get("generation_token_ids"), info.get("generation_log_probs")
    if gen is not None and lp is not None and len(gen) != len(lp):
        raise BackendReplyError(
            f"generation_token_ids ({len(gen)}) and generation_log_probs ({len(lp)}) differ in length"
        )
    return info


def _checked_token_field(key: str, value: Any) -> Any:
    """One token extension checked against its type (and normalised, for prefix_continuation).

    Split out of ``_token_info`` so each field's rule stands on its own line.
    """
    if key == "weight_version":
        if isinstance(value, bool) or not isinstance(value, int):
            raise BackendReplyError(f"{key} must be an integer, got {value!r}")
    elif key == "prefix_continuation":  # the call continued a saved generation cut (or discarded it)
        try:
            value = PrefixContinuation.model_validate(value).model_dump()
        except ValidationError as exc:
            raise BackendReplyError(f"{key} is invalid: {exc.errors()[0]['msg']}") from None
    elif key == "generation_log_probs":
        if not isinstance(value, list) or not all(_is_number(v) for v in value):
            raise BackendReplyError(f"{key} must be a list of finite numbers")
    elif not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise BackendReplyError(f"{key} must be a list of integers")
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _count(usage: dict[str, Any], key: str) -> int:
    value = usage.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0
