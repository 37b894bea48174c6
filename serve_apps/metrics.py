"""The endpoint's metrics, exported with `ray.serve.metrics` (Ray's Prometheus endpoint and the
dashboard; Serve adds the application, deployment and replica tags; Ray prefixes ``ray_``).

Speculative decoding is counted with vLLM's names (``spec_decode_num_drafts``,
``spec_decode_num_draft_tokens``, ``spec_decode_num_accepted_tokens``,
``spec_decode_num_accepted_tokens_per_pos{position}``), so the mean acceptance length is
``1 + accepted / drafts`` and per-position acceptance ``accepted_per_pos / drafts`` on either
stack; ``spec_decode_steps{k}`` counts decoding steps by the draft length K the engine chose
(adaptive speculation changes it step by step; 0 is a plain step). Requests, tokens, latency
histograms and the running / waiting gauges are named as vLLM names them.
"""

from __future__ import annotations

from ray.serve import metrics

from aerie.engine.loop import LoopStats
from aerie.serving.records import RequestRecord

PREFIX = "aerie_"
LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
TOKEN_LATENCY_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56]


def _counter(name: str, description: str, tags: tuple[str, ...] = ()) -> metrics.Counter:
    return metrics.Counter(PREFIX + name, description=description, tag_keys=tags)


class ServeMetrics:
    """The `aerie.serving.service.Observer` of a replica."""

    def __init__(self) -> None:
        self.requests = _counter("requests", "Requests answered, by route and HTTP status "
                                 "(499: the client went away).", ("route", "status"))
        self.finished = _counter("request_success", "Completed requests by finish reason.", ("finished_reason",))
        self.prompt_tokens = _counter("prompt_tokens", "Prompt tokens of the requests run.")
        self.generation_tokens = _counter("generation_tokens", "Tokens generated.")
        self.ttft = metrics.Histogram(PREFIX + "time_to_first_token_seconds", description="Time to first token.",
                                      boundaries=LATENCY_BUCKETS)
        self.tpot = metrics.Histogram(PREFIX + "time_per_output_token_seconds",
                                      description="Mean time per output token after the first, per request.",
                                      boundaries=TOKEN_LATENCY_BUCKETS)
        self.e2e = metrics.Histogram(PREFIX + "e2e_request_latency_seconds", description="Request latency.",
                                     boundaries=LATENCY_BUCKETS)
        self.running = metrics.Gauge(PREFIX + "num_requests_running", description="Sequences in the batch.")
        self.waiting = metrics.Gauge(PREFIX + "num_requests_waiting", description="Requests waiting for a slot.")
        self.drafts = _counter("spec_decode_num_drafts", "Drafts proposed (one per sequence and step that drafted).")
        self.draft_tokens = _counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.accepted = _counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = _counter("spec_decode_num_accepted_tokens_per_pos",
                                         "Draft tokens accepted at each draft position.", ("position",))
        self.steps_by_k = _counter("spec_decode_steps", "Decoding steps by draft length K (0: no drafting).", ("k",))
        self._last: LoopStats | None = None

    def request_done(self, record: RequestRecord) -> None:
        self.requests.inc(1, tags={"route": record.route, "status": str(record.status)})
        if record.finish_reason in ("stop", "length"):
            self.finished.inc(1, tags={"finished_reason": record.finish_reason})
        if record.prompt_tokens:
            self.prompt_tokens.inc(record.prompt_tokens)
        if record.completion_tokens:
            self.generation_tokens.inc(record.completion_tokens)
        if record.ttft_s is not None:
            self.ttft.observe(record.ttft_s)
        if record.tpot_s is not None:
            self.tpot.observe(record.tpot_s)
        if record.e2e_s is not None:
            self.e2e.observe(record.e2e_s)

    def engine_stats(self, stats: LoopStats) -> None:
        """Gauges now, counters by their growth since the last snapshot (the loop's are cumulative)."""
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        last = self._last
        spec, before = stats.spec, None if last is None else last.spec
        _grow(self.drafts, spec.drafts, before.drafts if before else 0)
        _grow(self.draft_tokens, spec.draft_tokens, before.draft_tokens if before else 0)
        _grow(self.accepted, spec.accepted_tokens, before.accepted_tokens if before else 0)
        for position, count in enumerate(spec.accepted_per_position):
            previous = before.accepted_per_position if before else []
            _grow(self.accepted_per_pos, count, previous[position] if position < len(previous) else 0,
                  {"position": str(position)})
        for k, steps in stats.k_histogram.items():
            _grow(self.steps_by_k, steps, last.k_histogram.get(k, 0) if last else 0, {"k": str(k)})
        self._last = stats


def _grow(counter: metrics.Counter, now: int, before: int, tags: dict[str, str] | None = None) -> None:
    if now > before:
        counter.inc(now - before, tags=tags)
