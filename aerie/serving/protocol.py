"""The OpenAI API surface: request bodies, validated the way OpenAI validates them, and its error shape.

`parse_request` turns the raw body of `POST /v1/completions` or `/v1/chat/completions` into a
`CompletionRequest` / `ChatRequest` or raises `APIError` (HTTP status + OpenAI's
``{"error": {"message", "type", "param", "code"}}``), the message naming the field. Types are
strict (``"5"`` is not an integer), unknown fields are refused as OpenAI refuses them, and fields
this server does not implement are accepted only at their neutral value (``presence_penalty: 0``,
``logprobs: null`` ...), so a request never silently gets behaviour it did not ask for.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_STOP = 4
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls"})
"""Accepted and without effect here (bookkeeping fields of the OpenAI API)."""
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (False,),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
}
"""Fields this server does not implement, and the values that ask for nothing."""


class APIError(Exception):
    """An HTTP error answered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class _Generation(BaseModel):
    """What completions and chat completions share: the model and the sampling settings."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> Any:
        stops = [value] if isinstance(value, str) else value
        if stops is None:
            return None
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError("must be a non-empty string or a list of non-empty strings")
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences, got {len(stops)}")
        return value

    @model_validator(mode="after")
    def _supported(self) -> _Generation:
        for name, value in (self.model_extra or {}).items():
            if name in IGNORED:
                continue
            if name not in NEUTRAL:
                raise _FieldError(name, f"Unrecognized request argument supplied: {name}")
            if not any(value == neutral and type(value) is type(neutral) for neutral in NEUTRAL[name]):
                raise _FieldError(name, f"{name}: not supported by this server")
        if self.n not in (None, 1):
            raise _FieldError("n", f"n: only n=1 is supported (got {self.n}); send one request per completion")
        if self.stream_options is not None and not self.stream:
            raise _FieldError("stream_options", "stream_options: only allowed when stream is true")
        return self

    @property
    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The max_tokens asked for, and the field that asked."""
        return self.max_tokens, "max_tokens"


class CompletionRequest(_Generation):
    """`POST /v1/completions`: one prompt, as text or token ids."""

    prompt: str | list[int]

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
            value = value[0]
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value and all(type(t) is int for t in value):
            return value
        if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
            raise ValueError(f"a batch of {len(value)} prompts is not supported; send one prompt per request")
        raise ValueError("must be a string, a list of token ids, or a one-element list of either")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError(f"only text content parts are supported, got {kind!r}")
        return value

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(_Generation):
    """`POST /v1/chat/completions`: a conversation, rendered with the target's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _one_limit(self) -> ChatRequest:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise _FieldError("max_completion_tokens", "max_completion_tokens: give it or max_tokens, not both")
        return self

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def template_messages(self) -> list[dict[str, str]]:
        """The conversation as the chat template (and ingest) sees it: text content, roles mapped."""
        return [{"role": ROLES[m.role], "content": m.text} for m in self.messages]


Route = Literal["completions", "chat"]
REQUEST_MODELS: dict[str, type[_Generation]] = {"completions": CompletionRequest, "chat": ChatRequest}


class _FieldError(ValueError):
    """A cross-field check that names its own field (pydantic would name the model)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def parse_request(route: Route, raw: bytes) -> CompletionRequest | ChatRequest:
    """The raw body of a generation route -> its validated request, or `APIError` (400)."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise APIError(400, f"We could not parse the JSON body of your request: {error}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"The request body must be a JSON object, not {type(body).__name__}")
    try:
        return REQUEST_MODELS[route].model_validate(body)
    except ValidationError as error:
        raise _as_api_error(error) from None


def _as_api_error(error: ValidationError) -> APIError:
    first = error.errors()[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, _FieldError):
        return APIError(400, cause.message, param=cause.param)
    param = _param(first["loc"])
    if first["type"] == "missing":
        return APIError(400, f"you must provide a {param} parameter", param=param)
    message = first["msg"].removeprefix("Value error, ")
    return APIError(400, f"{param}: {message}" if param else message, param=param)


def _param(loc: tuple[Any, ...]) -> str | None:
    """``("messages", 0, "content")`` -> ``messages[0].content``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None
