"""Continuous batching: a waiting queue, a fixed pool of slots, and who is running in each."""

from __future__ import annotations

import heapq
from collections import deque

from aerie.engine.request import Request, Status


class Scheduler:
    def __init__(self, slots: int) -> None:
        self._free = list(range(slots))
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def admit(self) -> None:
        """Move waiting requests into free slots, lowest slot first (keeps batches contiguous)."""
        while self.waiting and self._free:
            request = self.waiting.popleft()
            request.slot = heapq.heappop(self._free)
            request.status = Status.PREFILLING
            self.running[request.slot] = request

    def in_status(self, status: Status) -> list[Request]:
        return [self.running[s] for s in sorted(self.running) if self.running[s].status is status]

    def prefill_batch(self, budget: int) -> dict[Request, int]:
        """The prefilling rows one step feeds (by slot), each with how many prompt tokens.

        Every row of a prefill forward is padded to the widest block, so the step costs rows x
        width tokens: `budget` bounds that (a wall of long prompts can no longer stall the decoding
        rows for seconds), and the width is the one that feeds the most prompt tokens within it.
        Rows are taken in admission order, so the oldest always progresses; a prompt longer than
        the width is fed over several steps."""
        rows = [r for r in self.running.values() if r.status is Status.PREFILLING]
        remaining = [len(r.prompt_ids) - r.prefilled for r in rows]
        best_fed, width, count = 0, 0, 0
        for candidate in sorted({min(n, budget) for n in remaining}):
            rows_fit = min(len(rows), budget // candidate)
            fed = sum(min(n, candidate) for n in remaining[:rows_fit])
            if fed > best_fed:
                best_fed, width, count = fed, candidate, rows_fit
        batch = sorted(zip(rows[:count], remaining[:count], strict=True), key=lambda item: item[0].slot)
        return {request: min(n, width) for request, n in batch}

    def finish(self, request: Request, reason: str) -> None:
        request.status = Status.FINISHED
        request.finish_reason = reason
        if request.slot is not None:
            del self.running[request.slot]
            heapq.heappush(self._free, request.slot)
            request.slot = None
        elif request in self.waiting:
            self.waiting.remove(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
