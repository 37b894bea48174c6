"""The Data Capture writer: SageMaker's layout, atomic files, hour buckets, thread safety, S3."""

from __future__ import annotations

import gzip
import json
import re
import threading
from datetime import datetime, timedelta, timezone

from aerie import storage
from aerie.formats import DataCaptureWriter, capture_event, parse_line

LAYOUT = re.compile(r".*/ep/AllTraffic/\d{4}/\d{2}/\d{2}/\d{2}/[0-9a-f-]{36}\.jsonl(\.gz)?$")


def test_capture_event_shape():
    ev = capture_event({"inputs": "x"}, [{"generated_text": "y"}], encoding="BASE64", event_id="e1",
                       inference_time=datetime(2026, 4, 29, 0, 3, 18, tzinfo=timezone.utc), inference_id="i1")
    assert ev["eventVersion"] == "0"
    assert ev["eventMetadata"] == {"eventId": "e1", "inferenceTime": "2026-04-29T00:03:18Z", "inferenceId": "i1"}
    side = ev["captureData"]["endpointInput"]
    assert side["mode"] == "INPUT" and side["encoding"] == "BASE64"
    assert side["observedContentType"] == "application/json"
    assert ev["captureData"]["endpointOutput"]["mode"] == "OUTPUT"
    assert "endpointOutput" not in capture_event({"inputs": "x"})["captureData"]


def test_writer_layout_and_hour_buckets(tmp_path):
    t0 = datetime(2026, 4, 29, 10, 59, 50, tzinfo=timezone.utc)
    with DataCaptureWriter(str(tmp_path), "ep", max_records=1000) as w:
        for i in range(30):
            w.capture({"inputs": f"q{i}"}, {"generated_text": f"a{i}"}, inference_time=t0 + timedelta(seconds=i))
    files = storage.list_files(str(tmp_path))
    assert len(files) == 2  # 10:59 and 11:00
    assert all(LAYOUT.match(f) for f in files)
    assert {f.split("/")[-2] for f in files} == {"10", "11"}
    lines = [ln for f in files for ln in storage.read_text(f).splitlines()]
    assert len(lines) == 30
    assert {parse_line(ln).reply for ln in lines} == {f"a{i}" for i in range(30)}
    assert not list(tmp_path.rglob(".tmp-*"))


def test_writer_flushes_by_count_and_appends_new_files(tmp_path):
    w = DataCaptureWriter(str(tmp_path), "ep", max_records=10, compress=True)
    t = datetime(2026, 4, 29, 10, tzinfo=timezone.utc)
    for i in range(25):
        w.capture({"inputs": f"q{i}"}, inference_time=t)
    assert len(w.written) == 2  # two full flushes so far, 5 buffered
    w.close()
    assert len(w.written) == 3 and all(f.endswith(".jsonl.gz") for f in w.written)
    n = sum(len(gzip.decompress(open(f, "rb").read()).splitlines()) for f in w.written)
    assert n == 25
    assert w.flush() == []  # nothing buffered


def test_writer_is_thread_safe(tmp_path):
    w = DataCaptureWriter(str(tmp_path), "ep", max_records=7)

    def worker(k: int) -> None:
        for i in range(50):
            w.capture({"inputs": f"t{k}-{i}"}, {"generated_text": "ok"})

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    w.close()
    lines = [ln for f in storage.list_files(str(tmp_path)) for ln in storage.read_text(f).splitlines()]
    assert len(lines) == 400
    assert len({json.loads(ln)["eventMetadata"]["eventId"] for ln in lines}) == 400


def test_writer_accepts_serialised_lines_and_rejects_bad_names(tmp_path):
    ev = capture_event({"inputs": "x"}, inference_time="2026-01-02T03:04:05Z")
    w = DataCaptureWriter(str(tmp_path), "ep", variant="v1")
    w.add(json.dumps(ev) + "\n")
    [uri] = w.flush()
    assert "/ep/v1/2026/01/02/03/" in uri
    import pytest

    with pytest.raises(ValueError):
        DataCaptureWriter(str(tmp_path), "a/b")


def test_writer_to_s3(s3_bucket):
    root = f"{s3_bucket}/capture-writer"
    with DataCaptureWriter(root, "ep") as w:
        for i in range(5):
            w.capture({"inputs": f"q{i}"}, [{"generated_text": "a"}],
                      inference_time=datetime(2026, 4, 29, 1, tzinfo=timezone.utc))
    files = storage.list_files(root)
    assert len(files) == 1 and files[0].startswith("s3://") and LAYOUT.match(files[0])
    assert len(storage.read_text(files[0]).splitlines()) == 5
