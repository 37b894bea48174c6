"""Writing SageMaker Data Capture JSONL: one event per line, files laid out as
``<root>/<endpoint>/<variant>/yyyy/mm/dd/hh/<uuid>.jsonl`` (local or ``s3://``).

:class:`DataCaptureWriter` buffers events and writes each flush as new files (one per hour
bucket), atomically: S3 objects cannot be appended to, and readers never see half a file.
It is thread-safe, so a live server can call :meth:`DataCaptureWriter.capture` from request
handlers and :meth:`DataCaptureWriter.flush` from a timer and at shutdown.
"""

from __future__ import annotations

import base64
import json
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from aerie import storage

__all__ = ["capture_event", "DataCaptureWriter", "format_time"]


def format_time(t: datetime | None = None) -> str:
    """SageMaker's ``inferenceTime`` form: ``2026-04-29T00:03:18Z`` (UTC)."""
    t = t or datetime.now(timezone.utc)
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _side(payload: Any, mode: str, encoding: str, content_type: str) -> dict[str, str]:
    if isinstance(payload, (bytes, bytearray)):
        blob = bytes(payload)
    elif isinstance(payload, str):
        blob = payload.encode("utf-8")
    else:
        blob = json.dumps(payload, ensure_ascii=False).encode("utf-8")
    encoding = encoding.upper()
    if encoding == "JSON":
        data = blob.decode("utf-8")
    elif encoding == "BASE64":
        data = base64.b64encode(blob).decode("ascii")
    else:
        raise ValueError(f"encoding must be JSON or BASE64, not {encoding!r}")
    return {"observedContentType": content_type, "mode": mode, "data": data, "encoding": encoding}


def capture_event(
    request: Any,
    response: Any | None = None,
    *,
    encoding: str = "JSON",
    output_encoding: str | None = None,
    event_id: str | None = None,
    inference_time: datetime | str | None = None,
    inference_id: str | None = None,
    content_type: str = "application/json",
) -> dict[str, Any]:
    """One Data Capture event (a dict; ``json.dumps`` it for a line).

    ``request`` / ``response`` are JSON-able payloads (or already-serialised ``str``/``bytes``);
    ``response=None`` writes an input-only event. ``encoding`` is ``JSON`` or ``BASE64``
    (``output_encoding`` defaults to the same).
    """
    capture = {"endpointInput": _side(request, "INPUT", encoding, content_type)}
    if response is not None:
        capture["endpointOutput"] = _side(response, "OUTPUT", output_encoding or encoding, content_type)
    if isinstance(inference_time, datetime) or inference_time is None:
        inference_time = format_time(inference_time)
    meta = {"eventId": event_id or str(uuid.uuid4()), "inferenceTime": inference_time}
    if inference_id:
        meta["inferenceId"] = inference_id
    return {"captureData": capture, "eventMetadata": meta, "eventVersion": "0"}


def _hour_of(event: dict[str, Any]) -> str:
    raw = (event.get("eventMetadata") or {}).get("inferenceTime")
    t = None
    if isinstance(raw, str):
        try:
            t = datetime.fromisoformat(raw.replace("Z", "+00:00"))
        except ValueError:
            t = None
    t = t or datetime.now(timezone.utc)
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    return t.astimezone(timezone.utc).strftime("%Y/%m/%d/%H")


class DataCaptureWriter:
    """Buffered, thread-safe writer of Data Capture files under ``root/endpoint/variant``.

    ``max_records``: flush when this many events are buffered. ``max_seconds``: on
    :meth:`add`, flush when the oldest buffered event is older than this. ``compress``: write
    ``.jsonl.gz``. ``name_factory``: file names (default ``uuid4``; pass a seeded one for
    reproducible output).
    """

    def __init__(
        self,
        root: str,
        endpoint: str,
        variant: str = "AllTraffic",
        *,
        max_records: int = 1000,
        max_seconds: float | None = None,
        compress: bool = False,
        name_factory: Callable[[], str] | None = None,
    ) -> None:
        if not endpoint or "/" in endpoint or not variant or "/" in variant:
            raise ValueError("endpoint and variant must be non-empty names without '/'")
        self.root = str(root)
        self.endpoint = endpoint
        self.variant = variant
        self.max_records = max(1, int(max_records))
        self.max_seconds = max_seconds
        self.compress = compress
        self._name = name_factory or (lambda: str(uuid.uuid4()))
        self._lock = threading.Lock()
        self._buffer: list[dict[str, Any] | str] = []
        self._oldest: float | None = None
        self.written: list[str] = []

    @property
    def prefix(self) -> str:
        return storage.join(self.root, self.endpoint, self.variant)

    def add(self, event: dict[str, Any] | str) -> None:
        """Buffer one event (a dict, or an already-serialised JSON line)."""
        with self._lock:
            self._buffer.append(event)
            if self._oldest is None:
                self._oldest = time.monotonic()
            due = len(self._buffer) >= self.max_records or (
                self.max_seconds is not None and time.monotonic() - self._oldest >= self.max_seconds
            )
        if due:
            self.flush()

    def capture(self, request: Any, response: Any | None = None, **kwargs: Any) -> dict[str, Any]:
        """Build an event with :func:`capture_event` and buffer it; returns the event."""
        event = capture_event(request, response, **kwargs)
        self.add(event)
        return event

    def flush(self) -> list[str]:
        """Write what is buffered as new files (one per hour folder); returns their URIs."""
        with self._lock:
            events, self._buffer, self._oldest = self._buffer, [], None
        if not events:
            return []
        groups: dict[str, list[str]] = {}
        for ev in events:
            if isinstance(ev, str):
                line = ev.rstrip("\n")
                hour = _hour_of(json.loads(line))
            else:
                line = json.dumps(ev, ensure_ascii=False, separators=(",", ":"))
                hour = _hour_of(ev)
            groups.setdefault(hour, []).append(line)
        out = []
        suffix = ".jsonl.gz" if self.compress else ".jsonl"
        for hour in sorted(groups):
            uri = storage.join(self.prefix, *hour.split("/"), f"{self._name()}{suffix}")
            data = ("\n".join(groups[hour]) + "\n").encode("utf-8")
            with storage.atomic_write(uri, compress=self.compress) as f:
                f.write(data)
            out.append(uri)
        with self._lock:
            self.written.extend(out)
        return out

    def close(self) -> list[str]:
        return self.flush()

    def __enter__(self) -> DataCaptureWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
