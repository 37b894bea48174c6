"""The service without Ray, through its FastAPI app in-process: a dead engine loop fails the health
check (Serve then replaces the replica), and closing the service writes the captured traffic."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from aerie import storage
from aerie.formats import parse_line
from aerie.serving.config import ServeConfig
from aerie.serving.http import create_app
from aerie.serving.service import OpenAIService


@pytest.fixture
def service(served_target_dir, tmp_path):
    config = ServeConfig(target=str(served_target_dir), max_slots=2, max_len=128,
                         capture={"destination": str(tmp_path / "capture"), "flush_seconds": 3600})
    service = OpenAIService(config)
    yield service
    service.close()


def _call(service: OpenAIService, method: str, path: str, **kwargs) -> httpx.Response:
    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(service))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(call())


def test_a_dead_engine_loop_fails_the_health_check(service):
    assert _call(service, "GET", "/health").json() == {"status": "ok"}
    service.check_health()
    service.loop.stop()  # the loop thread ends, as it does when the engine itself raises
    with pytest.raises(RuntimeError, match="engine loop is dead"):
        service.check_health()
    response = _call(service, "GET", "/health")
    assert response.status_code == 503 and response.json()["error"]["code"] == "unhealthy"
    refused = _call(service, "POST", "/v1/completions", json={"model": "tiny-served", "prompt": "x", "max_tokens": 2})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_unavailable"


def test_close_writes_the_captured_exchange(service):
    body = {"model": "tiny-served", "messages": [{"role": "user", "content": "Hello?"}], "max_tokens": 6,
            "temperature": 0}
    reply = _call(service, "POST", "/v1/chat/completions", json=body).json()
    uri = service.config.capture.uri
    assert not storage.exists(uri), "captured before the flush"
    service.close()
    [file] = storage.list_files(uri, (".jsonl",))
    [line] = storage.read_text(file).splitlines()
    event = json.loads(line)
    assert json.loads(event["captureData"]["endpointInput"]["data"]) == body
    assert event["eventMetadata"]["inferenceId"] == reply["id"]
    record = parse_line(line)
    assert record.reply == reply["choices"][0]["message"]["content"] and record.messages[0].content == "Hello?"
