"""Wire models for the OpenAI-compatible chat-completions endpoint.

Unknown request fields are ignored (clients such as Gym's model server send
``tool_choice``, ``parallel_tool_calls`` ...), but fields we cannot honour
(``stream``, ``n`` != 1, ``top_p`` != 1, ``stop``) are rejected so the caller
is not silently given something else.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[Any]
    tools: list[dict[str, Any]] | None = None
    temperature: float | None = Field(default=None, ge=0.0)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = None
    stop: str | list[str] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0)
    seed: int | None = None

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

    @field_validator("tools")
    @classmethod
    def _tools(cls, v):
        for i, t in enumerate(v or []):
            name = (t.get("function") or {}).get("name", t.get("name"))
            if not isinstance(name, str) or not name:
                raise ValueError(f"tools[{i}] has no function name")
        return v


def error_body(message: str, param: str | None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}
