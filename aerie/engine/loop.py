"""One engine, stepped on its own thread, serving many concurrent callers (continuous batching).

`Engine` is single-threaded. `EngineLoop` owns it on a dedicated thread: callers `submit` from any
thread or event loop, the loop admits them at the next step, and every step batches all running
requests together. Each caller reads its request's outputs from a `RequestHandle`, synchronously or
with `async for`, so an asyncio server (Ray Serve, a Ray actor) never blocks its event loop on a
forward pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field

from aerie.engine.engine import Engine
from aerie.engine.metrics import SpecCounters
from aerie.engine.request import RequestOutput, SamplingParams

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """The waiting queue is at its bound; the caller should retry later (HTTP 429)."""


class LoopDead(RuntimeError):
    """The engine loop has stopped; the replica must be restarted."""


class RequestHandle:
    """A submitted request: its outputs arrive in order, the last one has `finished=True`.

    Created on the caller's side. When the caller runs an asyncio loop, outputs are handed to it
    with `call_soon_threadsafe`; otherwise they go through a thread-safe queue."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.submitted_at = time.perf_counter()
        self.prompt_tokens = 0
        """Set when the engine registers the request."""
        self.spec = SpecCounters()
        """The request's speculation counters (the engine's own object: final once it finishes)."""
        self._event_loop = _running_loop()
        self._outputs: asyncio.Queue[RequestOutput | BaseException] | queue.SimpleQueue[
            RequestOutput | BaseException
        ] = asyncio.Queue() if self._event_loop is not None else queue.SimpleQueue()
        self._error: BaseException | None = None
        self._cancel: threading.Event = threading.Event()

    def deliver(self, item: RequestOutput | BaseException) -> None:
        """Called from the loop thread."""
        if self._event_loop is None:
            self._outputs.put(item)
            return
        try:
            self._event_loop.call_soon_threadsafe(self._outputs.put_nowait, item)
        except RuntimeError:
            pass  # the caller's event loop has closed: nobody is listening any more

    def cancel(self) -> None:
        """Stop generating (a client went away); the slot is freed at the next step."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def __iter__(self) -> Iterator[RequestOutput]:
        assert isinstance(self._outputs, queue.SimpleQueue), "created in an event loop: use `async for`"
        while True:
            output = self._merged(self._error or self._outputs.get())
            yield output
            if output.finished:
                return

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        assert isinstance(self._outputs, asyncio.Queue), "created outside an event loop: use `for`"
        while True:
            output = self._merged(self._error or await self._outputs.get())
            yield output
            if output.finished:
                return

    def _merged(self, item: RequestOutput | BaseException) -> RequestOutput:
        """`item` and every output already queued behind it, as one: a caller that fell behind
        (a busy event loop, a slow client) reads one chunk per wake-up, not one per engine step."""
        if isinstance(item, BaseException):
            raise item
        while not item.finished and not self._outputs.empty():
            later = self._outputs.get_nowait()
            if isinstance(later, BaseException):
                self._error = later  # raised at the next read, after what came before it
                break
            item = item.followed_by(later)
        return item


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


@dataclass
class _Submission:
    handle: RequestHandle
    prompt: str | Sequence[int]
    params: SamplingParams
    on_admitted: Callable[[], object] | None = None
    """Called from the loop thread once registered (or refused): wakes an asyncio caller."""
    admitted: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def settle(self, error: BaseException | None = None) -> None:
        self.error = error
        self.admitted.set()
        if self.on_admitted is not None:
            self.on_admitted()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


@dataclass(frozen=True)
class LoopStats:
    """A consistent snapshot for metrics: what runs, what waits, what speculation did so far."""

    running: int
    waiting: int
    steps: int
    decode_steps: int
    decode_rows: int
    decode_tokens: int
    k_histogram: dict[int, int]
    spec: SpecCounters


class EngineLoop:
    """Steps `engine` on a daemon thread while it has work; sleeps when idle.

    `max_waiting` bounds the requests not yet in a slot (submit raises `QueueFull` beyond it)."""

    def __init__(self, engine: Engine, max_waiting: int | None = None) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self._inbox: queue.SimpleQueue[_Submission] = queue.SimpleQueue()
        self._handles: dict[str, RequestHandle] = {}
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._ids = itertools.count()
        self._stats = self._snapshot()
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="aerie-engine-loop", daemon=True)
        self._thread.start()

    # ---- callers' side (any thread) ------------------------------------------------------------

    def submit(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        timeout: float = 60.0,
    ) -> RequestHandle:
        """Queue a request and wait until the loop has registered it (at most one step): a request
        the engine refuses raises its ValueError here, before any output is promised."""
        handle, submission = self._enqueue(prompt, params, request_id)
        if not submission.admitted.wait(timeout):
            raise LoopDead("the engine loop did not register the request in time")
        return self._checked(handle, submission)

    async def submit_async(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> RequestHandle:
        """`submit` for asyncio callers: waits for registration without blocking the event loop."""
        event_loop = asyncio.get_running_loop()
        registered = event_loop.create_future()
        handle, submission = self._enqueue(
            prompt, params, request_id,
            on_admitted=lambda: event_loop.call_soon_threadsafe(_resolve, registered),
        )
        while not submission.admitted.is_set():
            if not self.alive:
                raise LoopDead(f"the engine loop has stopped: {self.failure!r}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(registered), timeout=0.5)
        return self._checked(handle, submission)

    def _enqueue(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None,
        request_id: str | None,
        on_admitted: Callable[[], object] | None = None,
    ) -> tuple[RequestHandle, _Submission]:
        if not self.alive:
            raise LoopDead(f"the engine loop has stopped: {self.failure!r}")
        with self._pending_lock:
            if self.max_waiting is not None and self._pending + self.waiting >= self.max_waiting:
                raise QueueFull(f"{self.max_waiting} requests are already waiting for a slot")
            self._pending += 1
        handle = RequestHandle(request_id or f"req-{next(self._ids)}-{time.time_ns():x}")
        submission = _Submission(handle, prompt, params or SamplingParams(), on_admitted)
        self._inbox.put(submission)
        self._wake.set()
        return handle, submission

    def _checked(self, handle: RequestHandle, submission: _Submission) -> RequestHandle:
        if submission.error is not None:
            raise submission.error
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        handle.cancel()
        self._wake.set()

    @property
    def waiting(self) -> int:
        """Requests registered but not yet in a slot (read live: `len` of a deque is atomic)."""
        return len(self.engine.scheduler.waiting)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.failure is None

    def stats(self) -> LoopStats:
        return self._stats

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout)

    # ---- the loop thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._admit()
                self._cancel_abandoned()
                if self.engine.has_unfinished():
                    self._deliver(self.engine.step())
                else:
                    self._wake.wait(0.5)
                    self._wake.clear()
                self._stats = self._snapshot()
        except BaseException as error:  # the engine isolates request failures; this is the engine itself
            log.exception("engine loop died")
            self.failure = error
            for handle in self._handles.values():
                handle.deliver(LoopDead(f"the engine loop died: {error!r}"))
            self._handles.clear()
            self._fail_inbox(error)

    def _admit(self) -> None:
        while True:
            try:
                submission = self._inbox.get_nowait()
            except queue.Empty:
                return
            handle = submission.handle
            error: ValueError | None = None
            try:
                self.engine.add_request(submission.prompt, submission.params, handle.request_id)
                request = self.engine.requests[handle.request_id]
                handle.prompt_tokens = len(request.prompt_ids)
                handle.spec = request.spec
                self._handles[handle.request_id] = handle
            except ValueError as refused:
                error = refused
            finally:
                with self._pending_lock:
                    self._pending -= 1
                submission.settle(error)

    def _fail_inbox(self, error: BaseException) -> None:
        while True:
            try:
                submission = self._inbox.get_nowait()
            except queue.Empty:
                return
            submission.settle(LoopDead(f"the engine loop died: {error!r}"))

    def _cancel_abandoned(self) -> None:
        for request_id in [rid for rid, handle in self._handles.items() if handle.cancelled]:
            output = self.engine.cancel(request_id)
            if output is not None:
                self._deliver([output])
            else:
                self._handles.pop(request_id)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            handle = self._handles.get(output.request_id)
            if handle is None:
                continue
            if output.finished:
                del self._handles[output.request_id]
            handle.deliver(output)

    def _snapshot(self) -> LoopStats:
        engine = self.engine
        scheduler = engine.scheduler
        spec = engine.spec
        stats = engine.stats
        return LoopStats(
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
            steps=stats.steps,
            decode_steps=stats.decode_steps,
            decode_rows=stats.decode_rows,
            decode_tokens=stats.decode_tokens,
            k_histogram=dict(stats.k_histogram),
            spec=SpecCounters(
                spec.drafts, spec.draft_tokens, spec.accepted_tokens, list(spec.accepted_per_position)
            ),
        )
