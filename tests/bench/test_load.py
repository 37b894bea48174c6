"""The closed-loop client against a real EngineLoop: the concurrency bound holds, outputs are the
target's greedy tokens, and speculation is counted over the measured window only."""

from __future__ import annotations

import asyncio

import pytest
from random_models import hf_greedy, random_model, random_prompts

from aerie.bench.load import closed_loop, measured_prompts, run_cell, warmup_prompts
from aerie.bench.metrics import cell_metrics
from aerie.engine import Engine, EngineConfig, SamplingParams
from aerie.engine.build import build_engine
from aerie.engine.loop import EngineLoop
from aerie.heads import new_head
from aerie.target import Target


@pytest.fixture(scope="module")
def model():
    return random_model("llama", seed=3)


def test_measured_and_warmup_prompts_do_not_depend_on_concurrency():
    assert measured_prompts(3, 5) == [0, 1, 2, 0, 1] and measured_prompts(5, 3, offset=3) == [3, 4, 0]
    assert warmup_prompts(3, 4) == [2, 1, 0, 2]


def test_no_more_than_max_concurrency_requests_are_in_flight(model):
    prompts = random_prompts([6, 9, 4, 12, 7])
    loop = EngineLoop(Engine(Target(model), EngineConfig(max_slots=8, max_len=64)))
    in_flight, peak = 0, 0

    async def watched() -> list:
        nonlocal in_flight, peak
        stop = asyncio.Event()

        async def watch() -> None:
            nonlocal peak
            while not stop.is_set():
                stats = loop.stats()
                peak = max(peak, stats.running + stats.waiting)
                await asyncio.sleep(0.001)

        watcher = asyncio.create_task(watch())
        records = await closed_loop(loop, prompts, [0, 1, 2, 3, 4, 0, 1], 2, SamplingParams(max_tokens=8))
        stop.set()
        await watcher
        return records

    records = asyncio.run(watched())
    loop.stop()
    assert 1 <= peak <= 2
    assert [r.prompt for r in records] == [0, 1, 2, 3, 4, 0, 1]
    assert [r.token_ids for r in records] == [hf_greedy(model, prompts[r.prompt], 8) for r in records]
    for r in records:
        assert sum(n for _, n in r.chunks) == len(r.token_ids) == 8
        assert r.submitted < r.chunks[0][0] <= r.chunks[-1][0] <= r.finished


def test_speculation_counters_cover_the_measured_window_only(model):
    target = Target(model)
    head = new_head(target, "eagle3", seed=0)  # untrained: it drafts every step, rarely accepted
    loop = EngineLoop(build_engine(target, EngineConfig(max_slots=4, max_len=64), "eagle3", head, 3))
    prompts = random_prompts([8] * 6, seed=5)
    params = SamplingParams(max_tokens=10)
    run = asyncio.run(run_cell(loop, prompts, concurrency=2, requests=4, warmup=3, params=params))
    loop.stop()
    warm = [r for r in run.records if not r.measured]
    assert [r.prompt for r in warm] == [5, 4, 3] and len(run.records) == 7
    # the engine's whole-life counters include the warm-up; the window's are exactly the rest
    total = loop.engine.spec
    assert run.counters.drafts < total.drafts
    single = Engine(target, EngineConfig(max_slots=1, max_len=64))
    measured = [r for r in run.records if r.measured]
    assert [r.token_ids for r in measured] == [c.token_ids for c in single.generate([prompts[i] for i in range(4)],
                                                                                     params)]
    tokens = sum(len(r.token_ids) for r in measured)
    # every measured token but each request's first (from its prefill) came from a decoding step
    assert run.counters.decode_tokens >= tokens - len(measured)
    assert run.counters.k_histogram == {3: run.counters.decode_steps}
    m = cell_metrics(run.records, run.counters)
    assert m["completed"] == 4 and m["total_output_tokens"] == tokens
    assert m["output_throughput"] == pytest.approx(tokens / run.wall_seconds, rel=0.05)
