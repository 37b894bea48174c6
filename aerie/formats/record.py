"""The normalised captured record and the error every parser raises."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = ["Message", "Record", "RecordError", "Reason", "ROLES"]

ROLES = ("system", "user", "assistant", "tool")


class Reason(str, Enum):
    """Machine-readable reasons a record is quarantined (the ``reason`` column)."""

    BAD_JSON = "bad_json"  # a line or a payload is not valid JSON
    BAD_BASE64 = "bad_base64"  # a BASE64 capture payload does not decode
    BAD_ENCODING = "bad_encoding"  # a capture ``encoding`` other than JSON / BASE64
    NOT_UTF8 = "not_utf8"  # the line (or a decoded payload) is not UTF-8
    LINE_TOO_LARGE = "line_too_large"  # the raw line is over the configured byte limit
    MISSING_CAPTURE_DATA = "missing_capture_data"  # Data Capture envelope without captureData
    MISSING_INPUT = "missing_input"  # a response without its request (output-only capture)
    EMPTY_PROMPT = "empty_prompt"  # nothing to condition on
    WRONG_TYPE = "wrong_type"  # a field has the wrong JSON type
    UNKNOWN_FORMAT = "unknown_format"  # a JSON object none of the parsers recognises
    UNKNOWN_PAYLOAD = "unknown_payload"  # a capture payload that is neither TGI nor OpenAI
    BAD_ROLE = "bad_role"  # a chat message role we cannot map
    UNSUPPORTED_CONTENT = "unsupported_content"  # e.g. image parts, token-id prompts, batches
    TEMPLATE_ERROR = "template_error"  # the chat template raised on this conversation
    TEMPLATE_PREFIX_MISMATCH = "template_prefix_mismatch"  # prompt render is not a prefix of the full one

    def __str__(self) -> str:
        return self.value


class RecordError(ValueError):
    """A record that cannot be used. ``reason`` is a :class:`Reason` value, ``detail`` is short text."""

    def __init__(self, reason: Reason | str, detail: str = "") -> None:
        self.reason = str(reason)
        self.detail = detail[:300]
        super().__init__(f"{self.reason}: {self.detail}" if detail else self.reason)

    def __reduce__(self):  # keep reason/detail through pickling (Ray moves exceptions around)
        return (RecordError, (self.reason, self.detail))


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str

    def to_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass(slots=True)
class Record:
    """One captured request, normalised.

    ``messages`` is the prompt side (system / user / earlier assistant turns); ``reply`` is the
    captured answer to it (``None`` for input-only captures: kept, to be regenerated later).
    ``kind`` says how the request arrived: ``chat`` (a messages list) or ``completion`` (one raw
    prompt string, TGI ``inputs`` or an OpenAI completions ``prompt``; held as one user message).
    ``format`` names the outer format: ``sagemaker``, ``openai``, ``sharegpt`` or ``prompt``.
    """

    id: str
    source: str
    line: int
    timestamp: str | None
    format: str
    kind: str
    messages: tuple[Message, ...]
    reply: str | None = None
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def has_reply(self) -> bool:
        return self.reply is not None

    def content_key(self) -> str:
        """Hash of what the model sees and says (kind, messages, reply): equal for exact duplicates."""
        payload = json.dumps(
            [self.kind, [[m.role, m.content] for m in self.messages], self.reply],
            ensure_ascii=False,
            separators=(",", ":"),
        )
        return hashlib.blake2b(payload.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()

    def conversation(self, with_reply: bool = True) -> list[dict[str, str]]:
        """The messages as chat-template input, with the reply as the last assistant turn."""
        out = [m.to_dict() for m in self.messages]
        if with_reply and self.reply is not None:
            out.append({"role": "assistant", "content": self.reply})
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "source": self.source,
            "line": self.line,
            "timestamp": self.timestamp,
            "format": self.format,
            "kind": self.kind,
            "messages": [m.to_dict() for m in self.messages],
            "reply": self.reply,
            "has_reply": self.has_reply,
            "params": dict(self.params),
        }
