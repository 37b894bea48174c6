"""The engine loop: many concurrent callers share one engine, batched, each gets its own tokens."""

from __future__ import annotations

import asyncio

import pytest
from random_models import hf_greedy, random_model, random_prompts

from aerie.engine import Engine, EngineConfig, SamplingParams
from aerie.engine.loop import EngineLoop, LoopDead, QueueFull, RequestHandle
from aerie.engine.request import RequestOutput
from aerie.target import Target


@pytest.fixture(scope="module")
def model():
    return random_model("llama", seed=11)


def test_concurrent_async_callers_are_batched_and_get_their_own_greedy_tokens(model):
    prompts = random_prompts([5, 9, 14, 7, 11, 6])
    loop = EngineLoop(Engine(Target(model), EngineConfig(max_slots=4, max_len=64)))

    async def one(prompt: list[int]) -> list[int]:
        handle = await loop.submit_async(prompt, SamplingParams(max_tokens=10))
        return [token async for output in handle for token in output.new_token_ids]

    async def everyone() -> list[list[int]]:
        return await asyncio.gather(*(one(p) for p in prompts))

    results = asyncio.run(everyone())
    loop.stop()
    assert results == [hf_greedy(model, p, 10) for p in prompts]
    stats = loop.stats()
    assert stats.running == 0 and stats.waiting == 0
    assert stats.decode_rows > stats.decode_steps, "requests shared decode steps"


def test_a_caller_that_fell_behind_reads_what_is_queued_as_one_output():
    handle = RequestHandle("r")
    for token in range(3):
        handle.deliver(RequestOutput("r", [token], f"<{token}>", finished=False))
    handle.deliver(LoopDead("the loop died"))
    outputs = iter(handle)
    assert next(outputs) == RequestOutput("r", [0, 1, 2], "<0><1><2>", finished=False)
    with pytest.raises(LoopDead):
        next(outputs)

    handle = RequestHandle("s")
    handle.deliver(RequestOutput("s", [5], "a", finished=False))
    handle.deliver(RequestOutput("s", [6], "b", finished=True, finish_reason="length"))
    assert list(handle) == [RequestOutput("s", [5, 6], "ab", finished=True, finish_reason="length")]


def test_refused_request_raises_at_submit_and_registers_nothing(model):
    loop = EngineLoop(Engine(Target(model), EngineConfig(max_slots=2, max_len=32)))
    with pytest.raises(ValueError, match="max_tokens"):
        loop.submit(random_prompts([10])[0], SamplingParams(max_tokens=40))
    handle = loop.submit(random_prompts([4])[0], SamplingParams(max_tokens=3))
    assert sum(len(o.new_token_ids) for o in handle) == 3
    loop.stop()
    assert loop.engine.requests == {}


def test_bounded_waiting_queue_refuses_beyond_the_bound(model):
    loop = EngineLoop(Engine(Target(model), EngineConfig(max_slots=1, max_len=64)), max_waiting=2)
    running = loop.submit(random_prompts([5])[0], SamplingParams(max_tokens=50))
    first = next(iter(running))
    waiting = [loop.submit(p, SamplingParams(max_tokens=4)) for p in random_prompts([4, 6])]
    with pytest.raises(QueueFull):
        loop.submit(random_prompts([4])[0], SamplingParams(max_tokens=4))
    rest = [sum(len(o.new_token_ids) for o in h) for h in [running, *waiting]]
    assert rest == [50 - len(first.new_token_ids), 4, 4]
    loop.stop()


def test_cancel_frees_the_slot_for_the_next_request(model):
    loop = EngineLoop(Engine(Target(model), EngineConfig(max_slots=1, max_len=64)))
    first = loop.submit(random_prompts([5])[0], SamplingParams(max_tokens=50))
    second = loop.submit(random_prompts([6])[0], SamplingParams(max_tokens=3))
    next(iter(first))
    loop.cancel(first)
    outputs = list(first)
    assert outputs[-1].finish_reason == "abort"
    assert sum(len(o.new_token_ids) for o in second) == 3
    loop.stop()
    assert loop.stats().running == 0


def test_a_dead_engine_fails_every_caller_and_reports_it(model):
    engine = Engine(Target(model), EngineConfig(max_slots=2, max_len=64))

    def broken_step():
        raise RuntimeError("device lost")

    engine.step = broken_step
    loop = EngineLoop(engine)
    handle = loop.submit(random_prompts([5])[0], SamplingParams(max_tokens=5))
    with pytest.raises(LoopDead, match="device lost"):
        list(handle)
    assert not loop.alive
    with pytest.raises(LoopDead):
        loop.submit(random_prompts([5])[0])
