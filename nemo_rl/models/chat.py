"""OpenAI chat messages -> the tokenizer's chat template, and completions -> tool calls.

Prompts are rendered by the Hugging Face tokenizer's own chat template
(``apply_chat_template(messages, tools=..., add_generation_prompt=True)``) as
text, then encoded without adding special tokens: the same two steps vLLM's
OpenAI server takes, so a prompt has the same ids whichever backend serves it.

Before rendering, messages are brought to the shape chat templates expect:

* ``developer`` becomes ``system``; a list of text parts is joined into one string;
* a tool message whose content is ``{"output": "<text>"}`` (the body a Gym
  resources server returns) renders as ``<text>``, so an agent that forwards the
  raw body and one that forwards the output give the same prompt;
* assistant ``tool_calls[*].function.arguments`` given as a JSON string become a
  dict (templates write them with ``tojson``); a string that is not a JSON
  object is kept as is;
* Responses-style tools (``{"type": "function", "name": ...}``) are wrapped as
  chat-completions tools (``{"type": "function", "function": {...}}``).

Tool calls in completions use the hermes format Qwen models emit and vLLM's
``hermes`` tool parser reads::

    <tool_call>
    {"name": "directory_find_email", "arguments": {"name": "bo"}}
    </tool_call>

``parse_tool_calls`` follows that parser: the content is the text before the
first ``<tool_call>``; every block (the last one may be unterminated) must be a
JSON object with a string ``name``; ``arguments`` (an object) is re-serialized
with ``json.dumps(..., ensure_ascii=False)``. If any block is malformed, nothing
is guessed: the whole text is the content and there are no tool calls.
``parse_reply`` runs it only for a request that lists tools, as vLLM runs its
tool parser only then: a reply to a request without tools is all content.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str | dict[str, Any] = "{}"


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


def validate_messages(messages: Any) -> list[ChatMessage]:
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


def _arguments_for_template(arguments: str | dict) -> str | dict:
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments)
    except (json.JSONDecodeError, RecursionError):
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def template_messages(messages: Any) -> list[dict[str, Any]]:
    """Validated messages in the plain shape chat templates expect (see the module docstring)."""
    out: list[dict[str, Any]] = []
    for m in validate_messages(messages):
        role = "system" if m.role == "developer" else m.role
        text = m.text()
        msg: dict[str, Any] = {"role": role, "content": tool_output_text(text) if role == "tool" else text}
        if m.role == "assistant" and m.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": _arguments_for_template(c.function.arguments)}}
                for c in m.tool_calls
            ]
        if m.role == "tool" and m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def template_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Chat-completions tool schemas (Responses-style flat tools are wrapped)."""
    if not tools:
        return None
    out = []
    for t in tools:
        if isinstance(t.get("function"), dict):
            out.append({"type": "function", "function": dict(t["function"])})
        else:
            fn = {k: v for k, v in t.items() if k in ("name", "description", "parameters")}
            out.append({"type": "function", "function": fn})
    return out


def render_text(tokenizer: Any, messages: Any, tools: list[dict] | None = None,
                add_generation_prompt: bool = True) -> str:
    """The chat template's text for ``messages`` (a ValueError names what is wrong)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template")
    msgs = template_messages(messages)
    try:
        return tokenizer.apply_chat_template(
            msgs, tools=template_tools(tools), add_generation_prompt=add_generation_prompt, tokenize=False
        )
    except ValueError:
        raise
    except Exception as e:  # jinja errors (raise_exception in a template, undefined fields...)
        raise ValueError(f"messages: the chat template could not render them: {e}") from None


def encode_text(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render_prompt(tokenizer: Any, messages: Any, tools: list[dict] | None = None,
                  add_generation_prompt: bool = True) -> list[int]:
    """Prompt token ids: the chat template's text, encoded without extra special tokens."""
    return encode_text(tokenizer, render_text(tokenizer, messages, tools, add_generation_prompt))


def render_with_mask(tokenizer: Any, messages: Any, tools: list[dict] | None = None,
                     stop_token_ids: set[int] | frozenset[int] = frozenset()) -> tuple[list[int], list[int]]:
    """Ids of a whole conversation and a mask that is 1 on what the assistant generated.

    The span of assistant message i is what follows the prompt the model saw for
    it (``messages[:i]`` with the generation prompt), up to and including the
    first stop token: exactly the tokens a rollout's model call generates. The
    template must render a conversation as a prefix-stable sequence; a template
    that does not (one that rewrites earlier turns) is an error.
    """
    msgs = template_messages(messages)
    full = render_prompt(tokenizer, msgs, tools, add_generation_prompt=False)
    mask = [0] * len(full)
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prompt = render_prompt(tokenizer, msgs[:i], tools, add_generation_prompt=True)
        upto = render_prompt(tokenizer, msgs[: i + 1], tools, add_generation_prompt=False)
        if full[: len(prompt)] != prompt or full[: len(upto)] != upto or len(upto) < len(prompt):
            raise ValueError(
                f"messages[{i}]: the chat template does not render the conversation prefix-stable, "
                "so the assistant tokens cannot be located"
            )
        end = len(upto)
        for j in range(len(prompt), len(upto)):
            if full[j] in stop_token_ids:
                end = j + 1
                break
        for j in range(len(prompt), end):
            mask[j] = 1
    return full, mask


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def format_tool_call(name: str, arguments: str | dict) -> str:
    """The hermes text of one call (arguments as a JSON object)."""
    args = _arguments_for_template(arguments)
    return f"{TOOL_CALL_OPEN}\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n{TOOL_CALL_CLOSE}"


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """Split a completion into (content, OpenAI ``tool_calls``); see the module docstring."""
    if TOOL_CALL_OPEN not in text:
        return (text.strip() or None), []
    calls: list[dict] = []
    for m in _TOOL_CALL_RE.finditer(text):
        body = m.group(1) if m.group(1) is not None else m.group(2)
        try:
            obj = json.loads(body.strip())
        except (json.JSONDecodeError, RecursionError):
            return (text.strip() or None), []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return (text.strip() or None), []
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except (json.JSONDecodeError, RecursionError):
                return (text.strip() or None), []
        if not isinstance(args, dict):
            return (text.strip() or None), []
        calls.append({"id": new_call_id(), "type": "function",
                      "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}})
    content = text[: text.index(TOOL_CALL_OPEN)].strip()
    return (content or None), calls


def parse_reply(text: str, tools: list | None) -> tuple[str | None, list[dict]]:
    """A served reply's (content, tool_calls): tool calls only when the request listed tools.

    vLLM's server parses tool calls only for a request that offers tools; a model may still write
    ``<tool_call>`` text without them, and a client that asked for none must get it as text.
    """
    if not tools:
        return (text.strip() or None), []
    return parse_tool_calls(text)
