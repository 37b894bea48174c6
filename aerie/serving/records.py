"""What the service reports about each request: the record behind the metrics and the log line,
and the observer interface the Ray Serve metrics implement (`serve_apps/metrics.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from aerie.engine.loop import LoopStats
from aerie.engine.metrics import SpecCounters

CLIENT_CLOSED = 499  # nginx's status for a request the client abandoned


@dataclass(frozen=True)
class RequestRecord:
    """One request, as metrics and the log line see it."""

    request_id: str
    route: str
    status: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    spec: SpecCounters | None = None
    detail: str = ""

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first, as vLLM defines TPOT."""
        if self.ttft_s is None or self.e2e_s is None or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)

    def log_line(self) -> str:
        if self.status >= 400 and self.status != CLIENT_CLOSED and self.finish_reason is None:
            return f"request {self.request_id} route={self.route} status={self.status} refused: {self.detail}"
        tau = self.spec.acceptance_length if self.spec is not None else None
        parts = [
            f"request {self.request_id}", f"route={self.route}", f"status={self.status}",
            f"prompt_tokens={self.prompt_tokens}", f"completion_tokens={self.completion_tokens}",
            f"finish={self.finish_reason}", f"tau={tau:.2f}" if tau is not None else "tau=-",
            f"ttft_ms={1000 * self.ttft_s:.1f}" if self.ttft_s is not None else "ttft_ms=-",
            f"e2e_ms={1000 * self.e2e_s:.1f}" if self.e2e_s is not None else "e2e_ms=-",
        ]
        return " ".join(parts + ([self.detail] if self.detail else []))


class Observer(Protocol):
    def request_done(self, record: RequestRecord) -> None: ...

    def engine_stats(self, stats: LoopStats) -> None: ...
