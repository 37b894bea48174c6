"""Capture written off the request path: nothing touches storage until a flush, flushes on close,
a failed write keeps its events for the next flush, and the files read back as captured traffic."""

from __future__ import annotations

import json
import time

import boto3

from aerie import storage
from aerie.formats import parse_line
from aerie.serving.capture import CaptureSink
from aerie.serving.config import CaptureConfig

REQUEST = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hi?"}]})
RESPONSE = {"object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello."},
                                                      "finish_reason": "stop"}]}


def _lines(uri: str) -> list[str]:
    return [line for f in storage.list_files(uri, (".jsonl",)) for line in storage.read_text(f).splitlines()]


def test_events_wait_for_a_flush_and_read_back(tmp_path):
    config = CaptureConfig(destination=str(tmp_path), endpoint="ep", flush_seconds=3600, encoding="BASE64")
    sink = CaptureSink(config)
    sink.add(REQUEST, RESPONSE, inference_id="chatcmpl-1")
    sink.add(REQUEST, None)
    assert not (tmp_path / "ep").exists(), "add() wrote to storage"
    [written] = sink.flush()
    assert written.startswith(str(tmp_path / "ep" / "AllTraffic"))
    records = [parse_line(line) for line in _lines(config.uri)]
    assert [r.reply for r in records] == ["Hello.", None]
    assert all(r.kind == "chat" and r.messages[0].content == "Hi?" for r in records)
    assert json.loads(_lines(config.uri)[0])["eventMetadata"]["inferenceId"] == "chatcmpl-1"
    sink.add(REQUEST, RESPONSE)
    sink.close()
    assert len(_lines(config.uri)) == 3 and (sink.captured, sink.written, sink.dropped) == (3, 3, 0)


def test_the_flusher_writes_on_its_own(tmp_path):
    sink = CaptureSink(CaptureConfig(destination=str(tmp_path), flush_seconds=0.05))
    sink.add(REQUEST, RESPONSE)
    deadline = time.monotonic() + 5
    while sink.written == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sink.written == 1 and sink.alive
    sink.close()


def test_a_failed_write_is_retried_and_loses_nothing(s3_server):
    bucket = "aerie-capture-later"
    config = CaptureConfig(destination=f"s3://{bucket}/capture", flush_seconds=3600, max_buffered=10)
    sink = CaptureSink(config)
    for _ in range(3):
        sink.add(REQUEST, RESPONSE)
    assert sink.flush() == [] and sink.failed_flushes == 1 and sink.written == 0  # no such bucket yet
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=bucket)
    sink.add(REQUEST, None)
    assert len(sink.flush()) == 1 and sink.written == 4 and sink.dropped == 0
    assert [parse_line(line).reply for line in _lines(config.uri)] == ["Hello."] * 3 + [None]
    sink.close()


def test_bounded_buffer_and_sampling(tmp_path):
    sink = CaptureSink(CaptureConfig(destination=str(tmp_path), flush_seconds=3600, max_buffered=2))
    for _ in range(5):
        sink.add(REQUEST, RESPONSE)
    assert sink.close() and (sink.written, sink.dropped) == (2, 3)
    never = CaptureSink(CaptureConfig(destination=str(tmp_path), sampling_percentage=0, flush_seconds=3600))
    always = CaptureSink(CaptureConfig(destination=str(tmp_path), flush_seconds=3600))
    assert not any(never.sampled() for _ in range(200)) and all(always.sampled() for _ in range(200))
    some = CaptureSink(CaptureConfig(destination=str(tmp_path), sampling_percentage=25, flush_seconds=3600))
    assert 20 < sum(some.sampled() for _ in range(400)) < 180
    for s in (never, always, some):
        s.close()
