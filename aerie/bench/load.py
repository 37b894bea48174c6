"""The closed-loop load generator: `max_concurrency` streaming clients against one `EngineLoop`.

A cell runs its warm-up requests, waits for the engine to go idle, snapshots the engine's
counters, runs the measured requests, waits for idle again and snapshots again: speculation
figures are the difference, so they cover the measured window only. Each client records, per
request, when it submitted, when every streamed chunk arrived and how many tokens it carried,
and the output ids (for the lossless check). In round r, measured request i asks prompt
(r x requests + i) mod n and warm-up request j prompt (n-1-j) mod n: every variant measures the
same prompts at every concurrency of a round, and later rounds move on through the traffic.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the records and maths load without torch (the report tasks need no engine)
    from aerie.engine.loop import EngineLoop, LoopStats
    from aerie.engine.request import SamplingParams


@dataclass
class RequestRecord:
    prompt: int
    """Index of the prompt in the run's prompt list."""
    prompt_tokens: int
    submitted: float
    chunks: list[tuple[float, int]] = field(default_factory=list)
    """(arrival time, tokens in the chunk) of every streamed chunk with tokens."""
    finished: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    error: str | None = None
    measured: bool = True

    @property
    def output_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class WindowCounters:
    """What the engine counted over the measured window (the difference of two snapshots)."""

    steps: int
    decode_steps: int
    decode_rows: int
    decode_tokens: int
    k_histogram: dict[int, int]
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: list[int]

    @classmethod
    def between(cls, before: LoopStats, after: LoopStats) -> WindowCounters:
        positions = after.spec.accepted_per_position
        earlier = before.spec.accepted_per_position + [0] * (len(positions) - len(before.spec.accepted_per_position))
        histogram = Counter(after.k_histogram)
        histogram.subtract(before.k_histogram)
        return cls(
            steps=after.steps - before.steps,
            decode_steps=after.decode_steps - before.decode_steps,
            decode_rows=after.decode_rows - before.decode_rows,
            decode_tokens=after.decode_tokens - before.decode_tokens,
            k_histogram={k: n for k, n in sorted(histogram.items()) if n},
            drafts=after.spec.drafts - before.spec.drafts,
            draft_tokens=after.spec.draft_tokens - before.spec.draft_tokens,
            accepted_tokens=after.spec.accepted_tokens - before.spec.accepted_tokens,
            accepted_per_position=[a - b for a, b in zip(positions, earlier, strict=True)],
        )


@dataclass
class CellRun:
    """One cell's raw measurements: every request (warm-up ones with measured=False), the wall
    time of the measured phase (first submit to last finish, taken around it), the counters."""

    records: list[RequestRecord]
    wall_seconds: float
    counters: WindowCounters | None = None


def measured_prompts(n_prompts: int, requests: int, offset: int = 0) -> list[int]:
    return [(offset + i) % n_prompts for i in range(requests)]


def warmup_prompts(n_prompts: int, warmup: int) -> list[int]:
    return [(n_prompts - 1 - j) % n_prompts for j in range(warmup)]


async def stream_one(loop: EngineLoop, prompts: Sequence[Sequence[int]], index: int, params: SamplingParams,
                     measured: bool) -> RequestRecord:
    """One streaming request, timed as a client sees it; an engine error is recorded, not raised."""
    record = RequestRecord(index, len(prompts[index]), time.perf_counter(), measured=measured)
    try:
        handle = await loop.submit_async(prompts[index], params)
        async for output in handle:
            now = time.perf_counter()
            if output.new_token_ids:
                record.chunks.append((now, len(output.new_token_ids)))
                record.token_ids += output.new_token_ids
            if output.error is not None:
                record.error = output.error
        record.finished = time.perf_counter()
    except ValueError as error:  # refused at submit (e.g. longer than the engine's max_len)
        record.error = f"{type(error).__name__}: {error}"
        record.finished = time.perf_counter()
    return record


async def closed_loop(loop: EngineLoop, prompts: Sequence[Sequence[int]], indices: list[int], concurrency: int,
                      params: SamplingParams, measured: bool = True,
                      on_done: Callable[[RequestRecord], None] | None = None) -> list[RequestRecord]:
    """`indices` requests, at most `concurrency` in flight (each client sends its next request as
    soon as its last one finished); records in request order."""
    gate = asyncio.Semaphore(concurrency)

    async def client(index: int) -> RequestRecord:
        async with gate:
            record = await stream_one(loop, prompts, index, params, measured)
        if on_done is not None:
            on_done(record)
        return record

    return list(await asyncio.gather(*(client(i) for i in indices)))


async def until_idle(loop: EngineLoop, poll: float = 0.001) -> LoopStats:
    """The loop's stats once nothing runs or waits: the snapshot taken after the last step."""
    while True:
        stats = loop.stats()
        if stats.running == 0 and stats.waiting == 0:
            return stats
        await asyncio.sleep(poll)


async def run_cell(loop: EngineLoop, prompts: Sequence[Sequence[int]], concurrency: int, requests: int, warmup: int,
                   params: SamplingParams, on_done: Callable[[RequestRecord], None] | None = None,
                   offset: int = 0) -> CellRun:
    """Warm-up, then the measured requests (from prompt `offset` on) with the engine's counters
    taken around them."""
    n = len(prompts)
    warm = await closed_loop(loop, prompts, warmup_prompts(n, warmup), concurrency, params, False)
    before = await until_idle(loop)
    start = time.perf_counter()
    records = await closed_loop(loop, prompts, measured_prompts(n, requests, offset), concurrency, params, True,
                                on_done)
    wall = time.perf_counter() - start
    after = await until_idle(loop)
    return CellRun(warm + records, wall, WindowCounters.between(before, after))
