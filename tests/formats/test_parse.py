"""Parsers: every supported shape, and a reason code for every way a line can be broken."""

from __future__ import annotations

import base64
import json

import pytest

from aerie.formats import Reason, RecordError, capture_event, detect_format, parse_line, parse_object

CHAT_REQ = {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "What is 2+2?"}], "max_tokens": 16}
CHAT_RESP = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1777420800,
             "choices": [{"index": 0, "message": {"role": "assistant", "content": "4"}, "finish_reason": "stop"}]}
COMPLETION_REQ = {"model": "m", "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0.2}
COMPLETION_RESP = {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": "\n    return a + b"}]}
TGI_REQ = {"inputs": "def add(a, b):", "parameters": {"max_new_tokens": 32, "temperature": 0.7}}


def line(obj) -> bytes:
    return json.dumps(obj).encode()


def reason_of(raw) -> str:
    with pytest.raises(RecordError) as e:
        parse_line(raw, "f.jsonl", 1)
    return e.value.reason


@pytest.mark.parametrize("encoding", ["JSON", "BASE64"])
@pytest.mark.parametrize(
    "req,resp,kind,reply",
    [
        (TGI_REQ, [{"generated_text": "\n    return a + b"}], "completion", "\n    return a + b"),
        (TGI_REQ, {"generated_text": "\n    return a + b"}, "completion", "\n    return a + b"),
        (CHAT_REQ, CHAT_RESP, "chat", "4"),
        (COMPLETION_REQ, COMPLETION_RESP, "completion", "\n    return a + b"),
    ],
)
def test_sagemaker_payloads(encoding, req, resp, kind, reply):
    event = capture_event(req, resp, encoding=encoding, event_id="ev-1", inference_time="2026-04-29T00:03:18Z")
    rec = parse_line(line(event), "s3://b/cap/x.jsonl", 7)
    assert (rec.id, rec.format, rec.kind, rec.reply) == ("ev-1", "sagemaker", kind, reply)
    assert rec.timestamp == "2026-04-29T00:03:18Z"
    assert (rec.source, rec.line) == ("s3://b/cap/x.jsonl", 7)
    assert rec.messages[-1].role == "user" and rec.messages[-1].content
    assert rec.params.get("max_tokens") in (8, 16, 32)


def test_sagemaker_input_only_and_mixed_encodings():
    rec = parse_line(line(capture_event(CHAT_REQ, None, encoding="BASE64")))
    assert rec.reply is None and not rec.has_reply
    assert [m.role for m in rec.messages] == ["system", "user"]
    mixed = capture_event(TGI_REQ, {"generated_text": "x = 1"}, encoding="JSON", output_encoding="BASE64")
    assert parse_line(line(mixed)).reply == "x = 1"


def test_sagemaker_return_full_text_is_stripped():
    req = {"inputs": "def f():", "parameters": {"return_full_text": True}}
    rec = parse_line(line(capture_event(req, [{"generated_text": "def f():\n    pass"}])))
    assert rec.reply == "\n    pass"
    assert "return_full_text" not in rec.params


def test_sagemaker_error_response_keeps_the_prompt():
    rec = parse_line(line(capture_event(CHAT_REQ, {"error": {"message": "overloaded"}})))
    assert rec.reply is None


def test_openai_logs():
    rec = parse_line(line({"request": CHAT_REQ, "response": CHAT_RESP}))
    assert (rec.format, rec.kind, rec.reply, rec.id) == ("openai", "chat", "4", "chatcmpl-1")
    assert rec.timestamp == "2026-04-29T00:00:00Z"
    rec = parse_line(line({"request": COMPLETION_REQ, "response": COMPLETION_RESP}))
    assert (rec.kind, rec.reply) == ("completion", "\n    return a + b")
    # Batch API input line (no response) and fine-tuning "messages" lines
    rec = parse_line(line({"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": CHAT_REQ}))
    assert (rec.id, rec.reply) == ("r1", None)
    ft = {"messages": CHAT_REQ["messages"] + [{"role": "assistant", "content": [{"type": "text", "text": "4"}]}]}
    rec = parse_line(line(ft))
    assert rec.reply == "4" and len(rec.messages) == 2
    # request wrapped with url/body, response wrapped with status_code/body
    rec = parse_line(line({"request": {"url": "/v1/chat/completions", "body": CHAT_REQ},
                           "response": {"status_code": 200, "body": CHAT_RESP}}))
    assert rec.reply == "4"


def test_sharegpt_and_prompt_lines():
    rec = parse_line(line({"id": "c1", "conversations": [
        {"from": "system", "value": "sys"}, {"from": "human", "value": "hi"},
        {"from": "gpt", "value": "hello"}, {"from": "human", "value": "and?"}, {"from": "gpt", "value": "bye"}]}))
    assert (rec.format, rec.id, rec.reply) == ("sharegpt", "c1", "bye")
    assert [m.role for m in rec.messages] == ["system", "user", "assistant", "user"]
    rec = parse_line(line({"conversations": [{"from": "human", "value": "only a question"}]}))
    assert rec.reply is None and rec.id.startswith("h-")
    rec = parse_line(line({"prompt": "Tell me a joke"}))
    assert (rec.format, rec.kind, rec.reply) == ("prompt", "completion", None)
    rec = parse_line(line({"prompt": ["def f():"], "completion": "  pass"}))
    assert rec.reply == "  pass"
    assert parse_line(line(TGI_REQ)).format == "prompt"


def test_detect_format():
    assert detect_format({"captureData": {}}) == "sagemaker"
    assert detect_format({"conversations": []}) == "sharegpt"
    assert detect_format({"request": {}}) == "openai"
    assert detect_format({"messages": []}) == "openai"
    assert detect_format({"prompt": "x"}) == "prompt"
    assert detect_format({"foo": 1}) is None
    assert detect_format([1]) is None


def test_duplicates_share_a_content_key_and_ids_are_stable():
    a = parse_line(line({"prompt": "x", "completion": "y"}), "a.jsonl", 1)
    b = parse_line(line({"prompt": "x", "completion": "y"}), "b.jsonl", 9)
    c = parse_line(line({"prompt": "x", "completion": "z"}), "a.jsonl", 2)
    assert a.content_key() == b.content_key() != c.content_key()
    assert a.id == b.id  # derived from content when the record carries none


def _side(data, encoding="JSON"):
    return {"observedContentType": "application/json", "mode": "INPUT", "data": data, "encoding": encoding}


@pytest.mark.parametrize(
    "raw,reason",
    [
        (b'{"captureData": {"endpointInput": ', Reason.BAD_JSON),
        (b"not json at all", Reason.BAD_JSON),
        (line({"captureData": {"endpointInput": _side("%%%not-base64%%%", "BASE64")}}), Reason.BAD_BASE64),
        (line({"captureData": {"endpointInput": _side(base64.b64encode(b"\xff\xfe{").decode(), "BASE64")}}),
         Reason.NOT_UTF8),
        (line({"captureData": {"endpointInput": _side(base64.b64encode(b"{oops").decode(), "BASE64")}}),
         Reason.BAD_JSON),
        (line({"captureData": {"endpointInput": _side('{"inputs": "x"')}}), Reason.BAD_JSON),
        (line({"captureData": {"endpointInput": _side("{}", "CSV")}}), Reason.BAD_ENCODING),
        (line({"eventMetadata": {"eventId": "x"}, "eventVersion": "0"}), Reason.MISSING_CAPTURE_DATA),
        (line({"captureData": {}}), Reason.MISSING_CAPTURE_DATA),
        (line({"captureData": {"endpointOutput": _side('{"generated_text": "x"}')}}), Reason.MISSING_INPUT),
        (line({"captureData": "oops"}), Reason.WRONG_TYPE),
        (b'{"prompt": "x"}\xff', Reason.NOT_UTF8),
        (line({"prompt": "   "}), Reason.EMPTY_PROMPT),
        (line({"messages": []}), Reason.EMPTY_PROMPT),
        (line({"messages": [{"role": "user", "content": ""}]}), Reason.EMPTY_PROMPT),
        (line(capture_event({"inputs": ""})), Reason.EMPTY_PROMPT),
        (line({"prompt": 42}), Reason.WRONG_TYPE),
        (line({"messages": "hello"}), Reason.WRONG_TYPE),
        (line({"messages": [{"role": "user", "content": 5}]}), Reason.WRONG_TYPE),
        (line(capture_event(TGI_REQ, {"generated_text": 5})), Reason.WRONG_TYPE),
        (line(capture_event({"inputs": ["a", "b"]})), Reason.UNSUPPORTED_CONTENT),
        (line({"prompt": [1, 2, 3]}), Reason.UNSUPPORTED_CONTENT),
        (line({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
         Reason.UNSUPPORTED_CONTENT),
        (line({"messages": [{"role": "wizard", "content": "hi"}]}), Reason.BAD_ROLE),
        (line([1, 2, 3]), Reason.WRONG_TYPE),
        (line("a string"), Reason.WRONG_TYPE),
        (line({"hello": "world"}), Reason.UNKNOWN_FORMAT),
        (line(capture_event({"query": "x"})), Reason.UNKNOWN_PAYLOAD),
        (line({"response": CHAT_RESP}), Reason.MISSING_INPUT),
        (line({"id": {"nested": 1}, "prompt": "x"}), Reason.WRONG_TYPE),
    ],
)
def test_broken_lines_have_reasons(raw, reason):
    assert reason_of(raw) == reason.value


def test_line_too_large():
    with pytest.raises(RecordError) as e:
        parse_line(line({"prompt": "x" * 5000}), max_bytes=1024)
    assert e.value.reason == "line_too_large"


def test_record_error_pickles_with_its_reason():
    import pickle

    err = pickle.loads(pickle.dumps(RecordError(Reason.BAD_JSON, "col 3")))
    assert (err.reason, err.detail) == ("bad_json", "col 3")


def test_parse_object_accepts_decoded_json_and_text_lines():
    assert parse_object({"prompt": "x"}).messages[0].content == "x"
    assert parse_line('{"prompt": "héllo"}').messages[0].content == "héllo"
