"""Our chat template and the text format for tool calls.

A conversation renders to token ids as::

    <|bos|> <|system|> text <|end|> <|user|> text <|end|>
    <|assistant|> content <call>NAME ARGS_JSON</call> ... <|end|>
    <|tool|> output <|end|> ... <|assistant|>

A tool message whose content is a JSON object ``{"output": "<text>"}`` (the
reply body of a Gym resources server) renders as ``<text>``, so an agent that
forwards the raw body and one that forwards the output give the same prompt.

The final ``<|assistant|>`` is the generation prompt; the model's reply ends
with ``<|end|>`` (the stop token), which is part of the generated tokens so the
policy learns when to stop. Tool schemas are not rendered: the policy learns
the tools from demonstrations, which keeps prompts short.

Tool call text format (what ``parse_completion`` accepts)::

    <call>directory_find_email {"name": "bo"}</call>

``NAME`` matches ``[A-Za-z_][A-Za-z0-9_.-]*``; ``ARGS_JSON`` must be a JSON
object. Several calls may follow each other; text outside calls is the reply
content. A call block that breaks any rule stays in the content verbatim, so a
malformed call reaches the environment as plain text instead of a guess.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from nemo_rl.models.tokenizer import Tokenizer

CALL_OPEN = "<call>"
CALL_CLOSE = "</call>"
TOOL_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_CALL_BLOCK_RE = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)
ROLE_TOKENS = {
    "system": "<|system|>",
    "developer": "<|system|>",
    "user": "<|user|>",
    "assistant": "<|assistant|>",
    "tool": "<|tool|>",
}


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str = "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str = ""
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """One OpenAI chat message; unknown fields (``name``, ``refusal``...) are ignored."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _parts_have_text(cls, v):
        if isinstance(v, list):
            for i, part in enumerate(v):
                if not isinstance(part.get("text", part.get("content")), str):
                    raise ValueError(f"content part {i} has no string 'text'")
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.get("text", p.get("content")) for p in self.content)


def validate_messages(messages: list[Any]) -> list[ChatMessage]:
    """Validate raw dicts; errors name the bad message index and field."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, ChatMessage):
            out.append(m)
            continue
        try:
            out.append(ChatMessage.model_validate(m))
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err["loc"])
            raise ValueError(f"messages[{i}].{loc}: {err['msg']}") from None
    return out


def format_tool_call(name: str, arguments: str | dict) -> str:
    """Text form of one call; dict arguments are dumped with json's default separators."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return f"{CALL_OPEN}{name} {args}{CALL_CLOSE}"


def assistant_ids(tokenizer: Tokenizer, content: str | None, tool_calls: list[ToolCall] | list[dict] | None) -> list[int]:
    """Token ids of an assistant reply body incl. the closing ``<|end|>``: what the policy generates."""
    ids = tokenizer.encode(content or "")
    for call in tool_calls or []:
        call = call if isinstance(call, ToolCall) else ToolCall.model_validate(call)
        ids.append(tokenizer.call_open_id)
        ids += tokenizer.encode(f"{call.function.name} {call.function.arguments}")
        ids.append(tokenizer.call_close_id)
    ids.append(tokenizer.end_id)
    return ids


def tool_output_text(content: str) -> str:
    """Unwrap a ``{"output": "<text>"}`` tool reply body; anything else is returned as is."""
    stripped = content.strip()
    if stripped.startswith("{") and stripped.endswith("}"):
        try:
            parsed = json.loads(stripped)
        except (json.JSONDecodeError, RecursionError):
            return content
        if isinstance(parsed, dict) and list(parsed) == ["output"] and isinstance(parsed["output"], str):
            return parsed["output"]
    return content


def render_with_mask(tokenizer: Tokenizer, messages: list[Any], add_generation_prompt: bool = True) -> tuple[list[int], list[int]]:
    """Render a chat history; ``mask[i]`` is 1 where token i was written by the assistant (body + ``<|end|>``)."""
    msgs = validate_messages(messages)
    ids = [tokenizer.bos_id]
    mask = [0]
    for m in msgs:
        ids.append(tokenizer.special_id(ROLE_TOKENS[m.role]))
        mask.append(0)
        if m.role == "assistant":
            body = assistant_ids(tokenizer, m.text(), m.tool_calls)
            flag = 1
        else:
            text = tool_output_text(m.text()) if m.role == "tool" else m.text()
            body = tokenizer.encode(text) + [tokenizer.end_id]
            flag = 0
        ids += body
        mask += [flag] * len(body)
    if add_generation_prompt:
        ids.append(tokenizer.special_id("<|assistant|>"))
        mask.append(0)
    return ids, mask


def render_messages(tokenizer: Tokenizer, messages: list[Any], add_generation_prompt: bool = True) -> list[int]:
    """Render a chat history to prompt ids (see module docstring)."""
    return render_with_mask(tokenizer, messages, add_generation_prompt)[0]


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse_completion(text: str) -> tuple[str | None, list[dict]]:
    """Split a completion into (content, OpenAI tool_calls); see the format in the module docstring."""
    calls: list[dict] = []
    kept: list[str] = []
    pos = 0
    for m in _CALL_BLOCK_RE.finditer(text):
        body = m.group(1).strip()
        name_m = TOOL_NAME_RE.match(body)
        call = None
        if name_m:
            rest = body[name_m.end():]
            if rest[:1].isspace() or rest[:1] == "{":
                rest = rest.strip()
                try:
                    parsed = json.loads(rest)
                except (json.JSONDecodeError, RecursionError):
                    parsed = None
                if isinstance(parsed, dict):
                    call = {
                        "id": new_call_id(),
                        "type": "function",
                        "function": {"name": name_m.group(0), "arguments": rest},
                    }
        kept.append(text[pos:m.start()])
        if call is None:
            kept.append(m.group(0))
        else:
            calls.append(call)
        pos = m.end()
    kept.append(text[pos:])
    content = "".join(kept).strip()
    return (content or None), calls
