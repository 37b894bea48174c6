"""OpenAI response bodies and Server-Sent Events chunks, for completions and chat completions.

One `ReplyFormat` per request knows its route, id, creation time and model, and builds every
body the request is answered with: the whole reply, or the stream's chunks (for chat, a first
chunk with the assistant role; text deltas; the finish reason; with
``stream_options.include_usage`` a last chunk with empty `choices` and the `usage`, every chunk
before it carrying ``"usage": null``), then ``data: [DONE]``.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass
class ReplyFormat:
    route: str
    """"completions" or "chat"."""
    model: str
    include_usage: bool = False
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

    @property
    def chat(self) -> bool:
        return self.route == "chat"

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def full(self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        """The non-streaming reply (also what a streamed reply is captured as)."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
            body = self._envelope("chat.completion", [choice])
        else:
            body = self._envelope("text_completion", [{"index": 0, "text": text, "logprobs": None,
                                                       "finish_reason": finish_reason}])
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body

    def _chunk(self, choice: dict[str, Any]) -> str:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])
        if self.include_usage:
            body["usage"] = None
        return sse(body)

    def opening(self) -> list[str]:
        """Chunks sent before any text: chat announces the assistant role."""
        if not self.chat:
            return []
        return [self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})]

    def delta(self, text: str, finish_reason: str | None = None) -> str:
        if self.chat:
            return self._chunk({"index": 0, "delta": {"content": text} if text else {}, "logprobs": None,
                                "finish_reason": finish_reason})
        return self._chunk({"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason})

    def closing(self, prompt_tokens: int, completion_tokens: int) -> list[str]:
        """The usage chunk (when asked for) and the end of the stream."""
        chunks = []
        if self.include_usage:
            body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
            body["usage"] = usage(prompt_tokens, completion_tokens)
            chunks.append(sse(body))
        return chunks + [DONE]
