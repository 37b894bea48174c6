"""Request validation as OpenAI does it (strict types, field-named 400s), and reply bodies that the
official client's own types accept."""

from __future__ import annotations

import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from aerie.serving.protocol import APIError, ChatRequest, CompletionRequest, parse_request
from aerie.serving.responses import DONE, ReplyFormat


def _body(**fields) -> bytes:
    return json.dumps({"model": "m", "prompt": "hi", **fields}).encode()


@pytest.mark.parametrize("raw, param, message", [
    (b"{", None, "We could not parse the JSON body"),
    (b'"text"', None, "must be a JSON object, not str"),
    (json.dumps({"prompt": "hi"}).encode(), "model", "you must provide a model parameter"),
    (_body(max_tokens=1.0), "max_tokens", "Input should be a valid integer"),
    (_body(max_tokens=True), "max_tokens", "Input should be a valid integer"),
    (_body(temperature=2.5), "temperature", "less than or equal to 2"),
    (_body(top_p=0), "top_p", "greater than 0"),
    (_body(seed=2**64), "seed", "less than 18446744073709551616"),
    (_body(stream="yes"), "stream", "valid boolean"),
    (_body(stop=["a", "b", "c", "d", "e"]), "stop", "at most 4 stop sequences"),
    (_body(stop=""), "stop", "non-empty string"),
    (_body(prompt=["a", "b"]), "prompt", "a batch of 2 prompts is not supported"),
    (_body(prompt=[]), "prompt", "must be a string, a list of token ids"),
    (_body(prompt=[1, "2"]), "prompt", "must be a string, a list of token ids"),
    (_body(n=3), "n", "only n=1 is supported"),
    (_body(logprobs=5), "logprobs", "not supported by this server"),
    (_body(echo=True), "echo", "not supported by this server"),
    (_body(frobnicate=1), "frobnicate", "Unrecognized request argument supplied: frobnicate"),
    (_body(stream_options={"include_usage": True}), "stream_options", "only allowed when stream is true"),
    (_body(stream=True, stream_options={"include_usage": True, "x": 1}), "stream_options.x", "Extra inputs"),
])
def test_bad_completion_requests(raw, param, message):
    with pytest.raises(APIError) as info:
        parse_request("completions", raw)
    error = info.value
    assert error.status == 400 and error.param == param and message in error.message
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}


def test_neutral_and_bookkeeping_fields_are_accepted():
    request = parse_request("completions", _body(presence_penalty=0, frequency_penalty=0.0, logprobs=None,
                                                 echo=False, best_of=1, user="u-1", n=1))
    assert isinstance(request, CompletionRequest) and request.prompt == "hi"
    assert parse_request("completions", _body(prompt=[[3, 4]])).prompt == [3, 4]
    assert parse_request("completions", _body(prompt=["text"])).prompt == "text"


def test_chat_requests():
    body = {"model": "m", "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
        {"role": "user", "content": "Hi", "name": "ann"},
    ], "max_completion_tokens": 7, "stop": "\n\n"}
    request = parse_request("chat", json.dumps(body).encode())
    assert isinstance(request, ChatRequest)
    assert request.template_messages() == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert request.requested_max_tokens == (7, "max_completion_tokens") and request.stops == ("\n\n",)
    for messages, param in [
        ([], "messages"),
        ([{"role": "robot", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content"),
        ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0].tool_calls"),
    ]:
        with pytest.raises(APIError) as info:
            parse_request("chat", json.dumps({"model": "m", "messages": messages}).encode())
        assert info.value.param == param


def _events(chunks: list[str]) -> list[dict]:
    assert chunks[-1] == DONE and all(c.startswith("data: ") and c.endswith("\n\n") for c in chunks)
    return [json.loads(c[len("data: "):]) for c in chunks[:-1]]


def test_replies_parse_as_the_openai_clients_types():
    completion = ReplyFormat("completions", "m")
    assert Completion.model_validate(completion.full("text", "length", 3, 4)).usage.total_tokens == 7
    chunks = completion.opening() + [completion.delta("te"), completion.delta("xt", "stop")] + completion.closing(3, 2)
    events = _events(chunks)  # the client's Completion type allows no null finish_reason: only the last has one
    assert "".join(e["choices"][0]["text"] for e in events) == "text"
    assert [e["choices"][0]["finish_reason"] for e in events] == [None, "stop"] and "usage" not in events[0]
    assert Completion.model_validate(events[-1]).choices[0].finish_reason == "stop"

    chat = ReplyFormat("chat", "m", include_usage=True)
    reply = ChatCompletion.model_validate(chat.full("hello", "stop", 5, 1))
    assert reply.choices[0].message.content == "hello" and reply.id.startswith("chatcmpl-")
    chunks = chat.opening() + [chat.delta("hel"), chat.delta("lo"), chat.delta("", "length")] + chat.closing(5, 2)
    parsed = [ChatCompletionChunk.model_validate(event) for event in _events(chunks)]
    assert parsed[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parsed if p.choices) == "hello"
    assert parsed[-1].choices == [] and parsed[-1].usage.completion_tokens == 2
    assert all(p.usage is None for p in parsed[:-1]) and len({p.id for p in parsed}) == 1
