"""The metric maths, named as `vllm bench serve` names them, over the measured requests only.

TTFT: first streamed token minus submit. TPOT: (E2EL - TTFT) / (output tokens - 1), for requests
with more than one token. ITL: the gaps between consecutive streamed chunks (a speculative step
streams several tokens in one chunk, as vLLM's does). E2EL: finish minus submit. Times in ms;
mean, median, std, p90, p99 as numpy computes them (linear interpolation, like vLLM).
`duration` runs from the first measured submit to the last measured finish;
`output_throughput` = output tokens / duration, `request_throughput` = completed / duration.
Speculation figures come from the engine's counters over the same window:
`spec_decode_acceptance_length` = 1 + accepted / drafts (the bonus token counted),
`spec_decode_acceptance_rate` = accepted / draft tokens, per-position rates = accepted at
position i / drafts; `tokens_per_step` = tokens a decoding row gains per engine step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from aerie.bench.load import RequestRecord, WindowCounters

LATENCIES = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (90, 99)


def latency_stats(name: str, values_s: Sequence[float]) -> dict[str, float | None]:
    """`mean_<name>_ms`, `median_`, `std_`, `p90_`, `p99_` (None when there is nothing to measure)."""
    keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms"] + [f"p{p}_{name}_ms" for p in PERCENTILES]
    if not values_s:
        return dict.fromkeys(keys)
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    values = [ms.mean(), np.median(ms), ms.std()] + [np.percentile(ms, p) for p in PERCENTILES]
    return {key: float(v) for key, v in zip(keys, values, strict=True)}


def request_latencies(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """Per-request TTFT, TPOT, E2EL and every inter-chunk gap, in seconds."""
    out: dict[str, list[float]] = {name: [] for name in LATENCIES}
    for r in records:
        if r.error is not None or not r.chunks:
            continue
        ttft = r.chunks[0][0] - r.submitted
        e2el = r.finished - r.submitted
        out["ttft"].append(ttft)
        out["e2el"].append(e2el)
        if r.output_tokens > 1:
            out["tpot"].append((e2el - ttft) / (r.output_tokens - 1))
        out["itl"] += [b[0] - a[0] for a, b in zip(r.chunks, r.chunks[1:], strict=False)]
    return out


def spec_metrics(counters: WindowCounters | None) -> dict:
    """Acceptance over the window; None where nothing was drafted (the baseline, peers)."""
    if counters is None:
        return {"spec_decode_num_drafts": None, "spec_decode_num_draft_tokens": None,
                "spec_decode_num_accepted_tokens": None, "spec_decode_acceptance_length": None,
                "spec_decode_acceptance_rate": None, "spec_decode_per_position_acceptance_rates": [],
                "spec_decode_accepted_per_position": [], "tokens_per_step": None, "decode_steps": None,
                "k_histogram": {}}
    drafts = counters.drafts
    return {
        "spec_decode_num_drafts": drafts,
        "spec_decode_num_draft_tokens": counters.draft_tokens,
        "spec_decode_num_accepted_tokens": counters.accepted_tokens,
        "spec_decode_acceptance_length": 1 + counters.accepted_tokens / drafts if drafts else None,
        "spec_decode_acceptance_rate": counters.accepted_tokens / counters.draft_tokens if counters.draft_tokens
        else None,
        "spec_decode_per_position_acceptance_rates": [n / drafts for n in counters.accepted_per_position]
        if drafts else [],
        "spec_decode_accepted_per_position": list(counters.accepted_per_position),
        "tokens_per_step": counters.decode_tokens / counters.decode_rows if counters.decode_rows else None,
        "decode_steps": counters.decode_steps,
        "k_histogram": dict(counters.k_histogram),
    }


def cell_metrics(records: Sequence[RequestRecord], counters: WindowCounters | None) -> dict:
    """The vllm-bench-serve figures of one cell from its measured requests and window counters."""
    measured = [r for r in records if r.measured]
    done = [r for r in measured if r.error is None]
    if measured:
        duration = max(r.finished for r in measured) - min(r.submitted for r in measured)
    else:
        duration = 0.0
    output_tokens = sum(r.output_tokens for r in done)
    input_tokens = sum(r.prompt_tokens for r in done)
    per_request = [r.output_tokens / (r.finished - r.submitted) for r in done if r.finished > r.submitted]
    out = {
        "completed": len(done),
        "failed": len(measured) - len(done),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "duration": duration,
        "request_throughput": len(done) / duration if duration > 0 else None,
        "output_throughput": output_tokens / duration if duration > 0 else None,
        "total_token_throughput": (input_tokens + output_tokens) / duration if duration > 0 else None,
        "output_throughput_per_request": float(np.mean(per_request)) if per_request else None,
    }
    latencies = request_latencies(done)
    for name in LATENCIES:
        out |= latency_stats(name, latencies[name])
    return out | spec_metrics(counters)
