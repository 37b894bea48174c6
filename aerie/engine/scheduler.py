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
