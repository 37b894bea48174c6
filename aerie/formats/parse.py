"""Parsers for captured traffic, one JSON line at a time, with the format detected per line.

Formats (``Record.format``):
- ``sagemaker``: SageMaker Data Capture (``captureData.endpointInput/endpointOutput``, ``encoding``
  JSON or BASE64, either side possibly missing) around a TGI/LMI payload (``{"inputs",
  "parameters"}`` -> ``[{"generated_text"}]`` / ``{"generated_text"}``) or an OpenAI
  chat/completions body.
- ``openai``: request/response logs (``{"request": body, "response": body}``, Batch API input and
  output lines, ``{"messages": [...]}`` fine-tuning lines).
- ``sharegpt``: ``{"conversations": [{"from": "human", "value": ...}, ...]}``.
- ``prompt``: plain ``{"prompt": ...}`` lines (optionally with ``completion`` / ``response``), and
  bare TGI requests ``{"inputs": ...}``.

Every failure raises :class:`RecordError` with a :class:`Reason`.
"""

from __future__ import annotations

import base64
import binascii
import json
from datetime import datetime, timezone
from typing import Any

from aerie.formats.record import Message, Reason, Record, RecordError

__all__ = ["parse_line", "parse_object", "detect_format", "parse_request", "parse_response"]

ROLE_ALIASES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}

_ABSENT = object()


def parse_line(
    raw: bytes | str, source: str = "", line: int = 0, *, max_bytes: int | None = None
) -> Record:
    """Parse one JSONL line (bytes as read from the file, or text) into a :class:`Record`."""
    if isinstance(raw, (bytes, bytearray, memoryview)):
        raw = bytes(raw)
        if max_bytes is not None and len(raw) > max_bytes:
            raise RecordError(Reason.LINE_TOO_LARGE, f"{len(raw)} bytes > {max_bytes}")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RecordError(Reason.NOT_UTF8, f"byte {e.start}") from None
    elif isinstance(raw, str):
        text = raw
        if max_bytes is not None and len(text) > max_bytes:
            raise RecordError(Reason.LINE_TOO_LARGE, f"{len(text)} chars > {max_bytes}")
    else:
        raise RecordError(Reason.WRONG_TYPE, f"line is {type(raw).__name__}")
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise RecordError(Reason.BAD_JSON, str(e)[:120]) from None
    return parse_object(obj, source, line)


def detect_format(obj: Any) -> str | None:
    """``sagemaker`` | ``openai`` | ``sharegpt`` | ``prompt`` for a parsed line, or None."""
    if not isinstance(obj, dict):
        return None
    if "captureData" in obj or "eventMetadata" in obj:
        return "sagemaker"
    if "conversations" in obj:
        return "sharegpt"
    if "request" in obj or "response" in obj or "messages" in obj or "body" in obj:
        return "openai"
    if "prompt" in obj or "inputs" in obj:
        return "prompt"
    return None


def parse_object(obj: Any, source: str = "", line: int = 0) -> Record:
    """Parse one already-decoded JSON value (a line) into a :class:`Record`."""
    if not isinstance(obj, dict):
        raise RecordError(Reason.WRONG_TYPE, f"line is a JSON {type(obj).__name__}, not an object")
    fmt = detect_format(obj)
    if fmt == "sagemaker":
        return _parse_sagemaker(obj, source, line)
    if fmt == "sharegpt":
        return _parse_sharegpt(obj, source, line)
    if fmt == "openai":
        return _parse_openai(obj, source, line)
    if fmt == "prompt":
        return _parse_prompt(obj, source, line)
    keys = ",".join(sorted(str(k) for k in obj)[:8])
    raise RecordError(Reason.UNKNOWN_FORMAT, f"keys: {keys}")


# ----------------------------------------------------------------------------- helpers


def _make(
    *,
    rid: Any,
    source: str,
    line: int,
    timestamp: Any,
    fmt: str,
    kind: str,
    messages: tuple[Message, ...],
    reply: str | None,
    params: dict[str, Any],
) -> Record:
    if reply is not None and not reply.strip():
        reply = None
    rec = Record(
        id="",
        source=source,
        line=line,
        timestamp=_timestamp(timestamp),
        format=fmt,
        kind=kind,
        messages=messages,
        reply=reply,
        params=params,
    )
    if rid is None or rid == "":
        rec.id = "h-" + rec.content_key()[:24]
    elif isinstance(rid, (str, int)) and not isinstance(rid, bool):
        rec.id = str(rid)
    else:
        raise RecordError(Reason.WRONG_TYPE, f"id is {type(rid).__name__}")
    return rec


def _timestamp(value: Any) -> str | None:
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, str):
        return value or None
    if isinstance(value, (int, float)):
        try:
            ts = float(value) / (1000.0 if value > 1e11 else 1.0)  # seconds or milliseconds
            return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat().replace("+00:00", "Z")
        except (OverflowError, OSError, ValueError):
            return None
    return None


def _params(*sources: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for src in sources:
        if not isinstance(src, dict):
            continue
        for key in ("max_new_tokens", "max_tokens", "max_completion_tokens"):
            v = src.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                out.setdefault("max_tokens", v)
        for key in ("temperature", "top_p"):
            v = src.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out.setdefault(key, float(v))
        if src.get("return_full_text") is True:
            out["return_full_text"] = True
    return out


def _text_content(value: Any, where: str) -> str:
    """OpenAI message content: a string, null, or a list of parts (text parts only)."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, list):
        texts = []
        for part in value:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text"):
                text = part.get("text")
                if not isinstance(text, str):
                    raise RecordError(Reason.WRONG_TYPE, f"{where}: text part is not a string")
                texts.append(text)
            elif isinstance(part, dict):
                raise RecordError(Reason.UNSUPPORTED_CONTENT, f"{where}: {part.get('type')!s} part")
            else:
                raise RecordError(Reason.WRONG_TYPE, f"{where}: content part {type(part).__name__}")
        return "".join(texts)
    raise RecordError(Reason.WRONG_TYPE, f"{where}: content is {type(value).__name__}")


def _messages(value: Any, where: str, role_key: str = "role", content_key: str = "content") -> list[Message]:
    if not isinstance(value, list):
        raise RecordError(Reason.WRONG_TYPE, f"{where} is {type(value).__name__}, not a list")
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise RecordError(Reason.WRONG_TYPE, f"{where}[{i}] is {type(item).__name__}")
        role = item.get(role_key, item.get("role"))
        if not isinstance(role, str):
            raise RecordError(Reason.WRONG_TYPE, f"{where}[{i}].{role_key} is {type(role).__name__}")
        mapped = ROLE_ALIASES.get(role.strip().lower())
        if mapped is None:
            raise RecordError(Reason.BAD_ROLE, f"{where}[{i}]: {role[:40]!r}")
        content = item.get(content_key, item.get("content"))
        out.append(Message(mapped, _text_content(content, f"{where}[{i}]")))
    return out


def _check_prompt(messages: list[Message] | tuple[Message, ...]) -> tuple[Message, ...]:
    if not messages or not any(m.content.strip() for m in messages):
        raise RecordError(Reason.EMPTY_PROMPT, "no prompt text")
    return tuple(messages)


def _prompt_text(value: Any, where: str) -> str:
    if isinstance(value, list):
        if len(value) == 1 and isinstance(value[0], str):
            value = value[0]
        elif value and all(isinstance(v, int) for v in value):
            raise RecordError(Reason.UNSUPPORTED_CONTENT, f"{where}: token ids")
        elif not value:
            raise RecordError(Reason.EMPTY_PROMPT, f"{where}: empty list")
        else:
            raise RecordError(Reason.UNSUPPORTED_CONTENT, f"{where}: batch of {len(value)}")
    if not isinstance(value, str):
        raise RecordError(Reason.WRONG_TYPE, f"{where} is {type(value).__name__}")
    if not value.strip():
        raise RecordError(Reason.EMPTY_PROMPT, f"{where} is blank")
    return value


def parse_request(body: Any) -> tuple[str, tuple[Message, ...], dict[str, Any]]:
    """A request payload -> ``(kind, messages, params)``.

    OpenAI chat (``messages``), OpenAI completions (``prompt``) or TGI/LMI (``inputs`` with
    optional ``parameters``).
    """
    if not isinstance(body, dict):
        raise RecordError(Reason.WRONG_TYPE, f"request is {type(body).__name__}")
    if "messages" in body:
        msgs = _check_prompt(_messages(body["messages"], "messages"))
        return "chat", msgs, _params(body)
    if "prompt" in body:
        text = _prompt_text(body["prompt"], "prompt")
        return "completion", (Message("user", text),), _params(body)
    if "inputs" in body:
        params = body.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise RecordError(Reason.WRONG_TYPE, f"parameters is {type(params).__name__}")
        text = _prompt_text(body["inputs"], "inputs")
        return "completion", (Message("user", text),), _params(params, body)
    keys = ",".join(sorted(str(k) for k in body)[:8])
    raise RecordError(Reason.UNKNOWN_PAYLOAD, f"request keys: {keys}")


def parse_response(body: Any) -> str | None:
    """A response payload -> the reply text, or None when it carries none (error, tool call)."""
    if isinstance(body, list):
        if not body:
            return None
        body = body[0]
        if not isinstance(body, dict) or "generated_text" not in body:
            raise RecordError(Reason.UNKNOWN_PAYLOAD, "response list without generated_text")
    if not isinstance(body, dict):
        raise RecordError(Reason.WRONG_TYPE, f"response is {type(body).__name__}")
    if "generated_text" in body:
        text = body["generated_text"]
        if not isinstance(text, str):
            raise RecordError(Reason.WRONG_TYPE, f"generated_text is {type(text).__name__}")
        return text
    if "choices" in body:
        choices = body["choices"]
        if not isinstance(choices, list):
            raise RecordError(Reason.WRONG_TYPE, f"choices is {type(choices).__name__}")
        if not choices:
            return None
        first = choices[0]
        if not isinstance(first, dict):
            raise RecordError(Reason.WRONG_TYPE, f"choices[0] is {type(first).__name__}")
        if "message" in first:
            msg = first["message"]
            if not isinstance(msg, dict):
                raise RecordError(Reason.WRONG_TYPE, f"message is {type(msg).__name__}")
            content = msg.get("content")
            return None if content is None else _text_content(content, "choices[0].message")
        if "text" in first:
            text = first["text"]
            if not isinstance(text, str):
                raise RecordError(Reason.WRONG_TYPE, f"choices[0].text is {type(text).__name__}")
            return text
        raise RecordError(Reason.UNKNOWN_PAYLOAD, "choice without message or text")
    if "error" in body:
        return None
    keys = ",".join(sorted(str(k) for k in body)[:8])
    raise RecordError(Reason.UNKNOWN_PAYLOAD, f"response keys: {keys}")


def _strip_full_text(reply: str | None, messages: tuple[Message, ...], params: dict[str, Any]) -> str | None:
    if reply is not None and params.pop("return_full_text", False) and len(messages) == 1:
        prompt = messages[0].content
        if reply.startswith(prompt):
            return reply[len(prompt) :]
    return reply


# ----------------------------------------------------------------------------- sagemaker


def _decode_capture(side: Any, name: str) -> Any:
    """One side of ``captureData`` -> the decoded JSON payload (``_ABSENT`` when it has no data)."""
    if not isinstance(side, dict):
        raise RecordError(Reason.WRONG_TYPE, f"{name} is {type(side).__name__}")
    data = side.get("data")
    encoding = side.get("encoding", "JSON")
    if not isinstance(encoding, str):
        raise RecordError(Reason.WRONG_TYPE, f"{name}.encoding is {type(encoding).__name__}")
    encoding = encoding.upper()
    if data is None or data == "":
        return _ABSENT
    if encoding == "JSON":
        if isinstance(data, (dict, list)):
            return data
        if not isinstance(data, str):
            raise RecordError(Reason.WRONG_TYPE, f"{name}.data is {type(data).__name__}")
        text = data
    elif encoding == "BASE64":
        if not isinstance(data, str):
            raise RecordError(Reason.WRONG_TYPE, f"{name}.data is {type(data).__name__}")
        try:
            blob = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as e:
            raise RecordError(Reason.BAD_BASE64, f"{name}: {e}") from None
        try:
            text = blob.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RecordError(Reason.NOT_UTF8, f"{name}: byte {e.start}") from None
    else:
        raise RecordError(Reason.BAD_ENCODING, f"{name}.encoding={encoding[:20]!r}")
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise RecordError(Reason.BAD_JSON, f"{name}: {str(e)[:100]}") from None


def _parse_sagemaker(obj: dict, source: str, line: int) -> Record:
    capture = obj.get("captureData")
    if capture is None:
        raise RecordError(Reason.MISSING_CAPTURE_DATA, "no captureData")
    if not isinstance(capture, dict):
        raise RecordError(Reason.WRONG_TYPE, f"captureData is {type(capture).__name__}")
    meta = obj.get("eventMetadata") or {}
    if not isinstance(meta, dict):
        raise RecordError(Reason.WRONG_TYPE, f"eventMetadata is {type(meta).__name__}")
    side_in = capture.get("endpointInput")
    side_out = capture.get("endpointOutput")
    if side_in is None:
        if side_out is None:
            raise RecordError(Reason.MISSING_CAPTURE_DATA, "captureData has neither side")
        raise RecordError(Reason.MISSING_INPUT, "output-only capture")
    request = _decode_capture(side_in, "endpointInput")
    if request is _ABSENT:
        raise RecordError(Reason.MISSING_CAPTURE_DATA, "endpointInput has no data")
    kind, messages, params = parse_request(request)
    reply = None
    if side_out is not None:
        response = _decode_capture(side_out, "endpointOutput")
        if response is not _ABSENT:
            reply = parse_response(response)
    reply = _strip_full_text(reply, messages, params)
    params.pop("return_full_text", None)
    return _make(
        rid=meta.get("eventId"),
        source=source,
        line=line,
        timestamp=meta.get("inferenceTime"),
        fmt="sagemaker",
        kind=kind,
        messages=messages,
        reply=reply,
        params=params,
    )


# ----------------------------------------------------------------------------- openai


def _unwrap_body(value: Any) -> Any:
    """``{"status_code": 200, "body": {...}}`` / ``{"url": ..., "body": {...}}`` -> the body."""
    if isinstance(value, dict) and isinstance(value.get("body"), dict):
        if not any(k in value for k in ("messages", "prompt", "inputs", "choices", "generated_text")):
            return value["body"]
    return value


def _parse_openai(obj: dict, source: str, line: int) -> Record:
    if "request" in obj or "body" in obj:
        request = _unwrap_body(obj["request"] if "request" in obj else obj)
        if request is None:
            raise RecordError(Reason.MISSING_INPUT, "request is null")
        kind, messages, params = parse_request(request)
        reply = None
        response = _unwrap_body(obj.get("response"))
        if response is not None:
            reply = parse_response(response)
        reply = _strip_full_text(reply, messages, params)
        resp_dict = response if isinstance(response, dict) else {}
        rid = obj.get("id") or obj.get("custom_id") or resp_dict.get("id")
        ts = obj.get("timestamp") or obj.get("created_at") or obj.get("created") or resp_dict.get("created")
        return _make(
            rid=rid,
            source=source,
            line=line,
            timestamp=ts,
            fmt="openai",
            kind=kind,
            messages=messages,
            reply=reply,
            params=params,
        )
    if "messages" in obj:
        msgs = _messages(obj["messages"], "messages")
        reply = None
        if msgs and msgs[-1].role == "assistant":
            reply = msgs.pop().content
        return _make(
            rid=obj.get("id"),
            source=source,
            line=line,
            timestamp=obj.get("timestamp") or obj.get("created"),
            fmt="openai",
            kind="chat",
            messages=_check_prompt(msgs),
            reply=reply,
            params=_params(obj),
        )
    # a response without its request (e.g. a Batch API output line)
    raise RecordError(Reason.MISSING_INPUT, "response without request")


# ----------------------------------------------------------------------------- sharegpt


def _parse_sharegpt(obj: dict, source: str, line: int) -> Record:
    turns = obj["conversations"]
    if not isinstance(turns, list):
        raise RecordError(Reason.WRONG_TYPE, f"conversations is {type(turns).__name__}")
    msgs = _messages(turns, "conversations", role_key="from", content_key="value")
    system = obj.get("system")
    if isinstance(system, str) and system.strip():
        msgs.insert(0, Message("system", system))
    reply = None
    if msgs and msgs[-1].role == "assistant":
        reply = msgs.pop().content
    return _make(
        rid=obj.get("id"),
        source=source,
        line=line,
        timestamp=obj.get("timestamp"),
        fmt="sharegpt",
        kind="chat",
        messages=_check_prompt(msgs),
        reply=reply,
        params={},
    )


# ----------------------------------------------------------------------------- prompt


def _parse_prompt(obj: dict, source: str, line: int) -> Record:
    kind, messages, params = parse_request(obj)
    reply = None
    for key in ("completion", "response", "reply", "generated_text"):
        if key in obj and obj[key] is not None:
            value = obj[key]
            if not isinstance(value, str):
                raise RecordError(Reason.WRONG_TYPE, f"{key} is {type(value).__name__}")
            reply = value
            break
    reply = _strip_full_text(reply, messages, params)
    return _make(
        rid=obj.get("id"),
        source=source,
        line=line,
        timestamp=obj.get("timestamp"),
        fmt="prompt",
        kind=kind,
        messages=messages,
        reply=reply,
        params=params,
    )
