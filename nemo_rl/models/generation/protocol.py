"""Wire models for the OpenAI-compatible chat-completions endpoint.

Unknown request fields are ignored (clients such as Gym's model server send
``tool_choice``, ``parallel_tool_calls`` ...), but fields we cannot honour
(``stream``, ``n`` != 1, ``top_p`` != 1, ``stop``) are rejected so the caller
is not silently given something else. ``top_logprobs`` (0..20) needs
``logprobs: true``, as in OpenAI's API. A tool must be a function with a name,
and its ``parameters``, when given, must be a JSON object (``check_tools``).
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gym_patches.checkpoint.cuts import CALL_ID_HEADER, CALL_ID_PATTERN, GenerationCut


MAX_TOP_LOGPROBS = 20


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[Any]
    tools: list[Any] | None = None
    temperature: float | None = Field(default=None, ge=0.0)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = None
    stop: str | list[str] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    seed: int | None = None
    ignore_eos: bool = False  # vLLM's extension: decode to the token limit
    ng_prefix: GenerationCut | None = None  # a saved generation cut to continue (gym_patches.checkpoint.cuts)

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v):
        if v is not None and v != 1.0:
            raise ValueError("only top_p=1 is supported")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v):
        if v is not None and v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("stream")
    @classmethod
    def _stream(cls, v):
        if v:
            raise ValueError("streaming is not supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v:
            raise ValueError("stop sequences are not supported (replies end at the end-of-turn token)")
        return v


def check_tools(tools: list[Any] | None) -> str | None:
    """The dotted field of the first bad tool with why (``"tools[1].function.parameters: ..."``), else None."""
    for i, t in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            return f"{where}: must be an object"
        if t.get("type", "function") != "function":
            return f"{where}.type: only 'function' tools are supported, got {t.get('type')!r}"
        fn, fwhere = (t["function"], f"{where}.function") if "function" in t else (t, where)
        if not isinstance(fn, dict):
            return f"{fwhere}: must be an object"
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            return f"{fwhere}.name: a tool needs a non-empty function name"
        if "parameters" in fn and fn["parameters"] is not None and not isinstance(fn["parameters"], dict):
            return f"{fwhere}.parameters: must be a JSON object (a JSON Schema), got {type(fn['parameters']).__name__}"
    return None


def error_body(message: str, param: str | None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}


def check_call_id(value: str | None) -> str | None:
    """Why an ``X-NG-Call-Id`` header value is unusable, naming the header, else None."""
    if value is not None and not re.match(CALL_ID_PATTERN, value):
        return f"{CALL_ID_HEADER}: {value[:80]!r} is not a call id (letters, digits and ._:- up to 160)"
    return None
