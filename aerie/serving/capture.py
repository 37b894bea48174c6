"""Data Capture of the endpoint's own traffic, written off the request path.

Request handlers only append an event to a bounded in-memory queue (`CaptureSink.add`). A
background thread hands the queue to `DataCaptureWriter` every `flush_seconds` (sooner once
`flush_records` are waiting) and at `close()`, so the next cycle's `aerie ingest` reads the
endpoint's traffic from ``<destination>/<endpoint>/<variant>/yyyy/mm/dd/hh/<uuid>.jsonl``. A write
that fails (storage down) puts its events back and is retried at the next flush; only beyond
`max_buffered` waiting events are the oldest dropped, and counted.
"""

from __future__ import annotations

import logging
import random
import threading
from collections import deque
from typing import Any

from aerie.formats.capture import DataCaptureWriter, capture_event
from aerie.serving.config import CaptureConfig


class CaptureSink:
    def __init__(self, config: CaptureConfig, log: logging.Logger | None = None) -> None:
        self.config = config
        self.log = log or logging.getLogger(__name__)
        # Only the flusher thread adds to the writer, and then flushes it: the writer never
        # flushes on its own (no record or age limit reached), so no request waits on storage.
        self.writer = DataCaptureWriter(
            config.destination, config.endpoint, config.variant, max_records=1 << 62, max_seconds=None
        )
        self._pending: deque[dict[str, Any]] = deque()
        self._pending_lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = threading.Event()
        self.captured = 0
        self.written = 0
        self.dropped = 0
        self.failed_flushes = 0
        self._thread = threading.Thread(target=self._run, name="aerie-capture-flush", daemon=True)
        self._thread.start()

    def sampled(self) -> bool:
        """Whether to capture the next request (`sampling_percentage` of them)."""
        pct = self.config.sampling_percentage
        return pct >= 100 or random.random() * 100 < pct

    def add(self, request: Any, response: Any | None, inference_id: str | None = None) -> None:
        """Queue one event (``response=None``: input only). Never touches storage."""
        event = capture_event(request, response, encoding=self.config.encoding, inference_id=inference_id)
        with self._pending_lock:
            if len(self._pending) >= self.config.max_buffered:
                self._pending.popleft()
                self.dropped += 1
            self._pending.append(event)
            self.captured += 1
            due = len(self._pending) >= self.config.flush_records
        if due:
            self._wake.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() or self._closing.is_set()

    def flush(self) -> list[str]:
        """Write every queued event now; returns the files written."""
        with self._flush_lock:
            with self._pending_lock:
                events = list(self._pending)
                self._pending.clear()
            if not events:
                return []
            for event in events:
                self.writer.add(event)
            try:
                files = self.writer.flush()
            except Exception as error:  # storage errors of any kind: keep the events, retry later
                self.failed_flushes += 1
                self.log.warning("capture: writing %d events to %s failed (%r); retrying", len(events),
                                 self.config.uri, error)
                with self._pending_lock:
                    room = max(self.config.max_buffered - len(self._pending), 0)
                    kept = events[-room:] if room else []
                    self.dropped += len(events) - len(kept)
                    self._pending.extendleft(reversed(kept))
                return []
            self.written += len(events)
            return files

    def _run(self) -> None:
        while True:
            self._wake.wait(self.config.flush_seconds)
            self._wake.clear()
            if self._closing.is_set():
                return  # close() writes the rest
            self.flush()

    def close(self) -> list[str]:
        """Stop the flusher and write what is left."""
        self._closing.set()
        self._wake.set()
        self._thread.join(timeout=60)
        return self.flush()
