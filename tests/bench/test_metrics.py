"""The metric maths on hand-made request timings, checked against numbers worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from aerie.bench.aggregate import aggregate
from aerie.bench.load import RequestRecord, WindowCounters
from aerie.bench.metrics import cell_metrics


def record(prompt, submitted, chunks, finished, measured=True, prompt_tokens=5):
    r = RequestRecord(prompt, prompt_tokens, submitted, measured=measured)
    for at, n in chunks:
        r.chunks.append((at, n))
        r.token_ids += [7] * n
    r.finished = finished
    return r


def counters(drafts=0, draft_tokens=0, accepted=0, per_position=(), rows=0, tokens=0, histogram=None):
    return WindowCounters(steps=rows, decode_steps=rows, decode_rows=rows, decode_tokens=tokens,
                          k_histogram=histogram or {}, drafts=drafts, draft_tokens=draft_tokens,
                          accepted_tokens=accepted, accepted_per_position=list(per_position))


def test_latencies_and_throughput_follow_vllm_bench_serve():
    records = [
        # 1 + 3 + 2 tokens: TTFT 0.1, E2EL 0.5, TPOT (0.5 - 0.1) / 5, ITL 0.2 and 0.2
        record(0, 10.0, [(10.1, 1), (10.3, 3), (10.5, 2)], 10.5),
        # 1 + 1 tokens, from 10.2: TTFT 0.2, E2EL 0.6, TPOT 0.4, ITL 0.4
        record(1, 10.2, [(10.4, 1), (10.8, 1)], 10.8),
        # warm-up: ignored
        record(2, 9.0, [(9.5, 1)], 9.5, measured=False),
    ]
    m = cell_metrics(records, counters(drafts=4, draft_tokens=8, accepted=4, per_position=[3, 1], rows=4, tokens=7,
                                        histogram={2: 4}))
    assert m["completed"] == 2 and m["failed"] == 0
    assert m["duration"] == pytest.approx(0.8)  # first measured submit 10.0 -> last finish 10.8
    assert m["total_output_tokens"] == 8 and m["output_throughput"] == pytest.approx(8 / 0.8)
    assert m["request_throughput"] == pytest.approx(2 / 0.8)
    assert m["total_token_throughput"] == pytest.approx(18 / 0.8)
    assert m["mean_ttft_ms"] == pytest.approx(150) and m["median_ttft_ms"] == pytest.approx(150)
    assert m["p99_ttft_ms"] == pytest.approx(np.percentile([100, 200], 99))
    assert m["mean_tpot_ms"] == pytest.approx((80 + 400) / 2)
    assert m["mean_itl_ms"] == pytest.approx((200 + 200 + 400) / 3) and m["median_itl_ms"] == pytest.approx(200)
    assert m["mean_e2el_ms"] == pytest.approx(550)
    assert m["output_throughput_per_request"] == pytest.approx((6 / 0.5 + 2 / 0.6) / 2)
    assert m["spec_decode_acceptance_length"] == pytest.approx(2.0)
    assert m["spec_decode_acceptance_rate"] == pytest.approx(0.5)
    assert m["spec_decode_per_position_acceptance_rates"] == [0.75, 0.25]
    assert m["tokens_per_step"] == pytest.approx(7 / 4) and m["k_histogram"] == {2: 4}


def test_failed_requests_are_counted_not_timed():
    ok = record(0, 0.0, [(0.1, 1), (0.2, 1)], 0.2)
    failed = record(1, 0.0, [], 0.3)
    failed.error = "RuntimeError: boom"
    m = cell_metrics([ok, failed], None)
    assert (m["completed"], m["failed"]) == (1, 1)
    assert m["duration"] == pytest.approx(0.3) and m["output_throughput"] == pytest.approx(2 / 0.3)
    assert m["mean_ttft_ms"] == pytest.approx(100)
    assert m["spec_decode_acceptance_length"] is None and m["spec_decode_per_position_acceptance_rates"] == []


def cell(variant, method, concurrency, round_, records, window):
    return {"variant": variant, "method": method, "k": 2 if method != "none" else 0, "tree": False, "head": None,
            "lookup": False, "round": round_, "concurrency": concurrency, "wall_seconds": 1.0,
            "metrics": cell_metrics(records, window),
            "counters": None if window is None else window.__dict__,
            "requests": [{"measured": r.measured} for r in records]}


def test_rows_take_medians_over_repeats_and_pool_acceptance():
    one = [record(0, 0.0, [(0.1, 1), (0.2, 1)], 0.2)]  # 10 tok/s
    two = [record(0, 0.0, [(0.1, 1), (0.2, 1)], 0.4)]  # 5 tok/s
    three = [record(0, 0.0, [(0.1, 1), (0.2, 1)], 0.1)]  # 20 tok/s
    cells = [
        cell("none", "none", 1, 0, one, None), cell("none", "none", 1, 1, one, None),
        cell("eagle3 K=2", "eagle3", 1, 0, two, counters(2, 4, 4, [2, 2], 2, 6, {2: 2})),
        cell("eagle3 K=2", "eagle3", 1, 1, three, counters(2, 4, 0, [0, 0], 2, 2, {2: 2})),
        cell("eagle3 K=2", "eagle3", 1, 2, one, counters(4, 8, 2, [2, 0], 4, 6, {2: 4})),
    ]
    rows = aggregate(cells, ["none", "eagle3 K=2"], "none")
    base, spec = rows
    assert (base["variant"], spec["variant"]) == ("none", "eagle3 K=2")
    assert spec["repeats"] == 3 and spec["output_throughput_repeats"] == pytest.approx([5, 20, 10])
    assert spec["output_throughput"] == pytest.approx(10) and spec["speedup"] == pytest.approx(1.0)
    assert spec["output_throughput_spread"] == pytest.approx((20 - 5) / 10)
    assert spec["spec_decode_num_drafts"] == 8 and spec["spec_decode_acceptance_length"] == pytest.approx(1 + 6 / 8)
    assert spec["spec_decode_per_position_acceptance_rates"] == [0.5, 0.25]
    assert spec["k_histogram"] == {2: 8} and spec["requests"] == 1
