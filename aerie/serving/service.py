"""The OpenAI-compatible service around one engine loop: no Ray, no HTTP framework.

`OpenAIService` owns ONE `EngineLoop` (the engine stepped on its own thread, every concurrent
request in the same continuous batch) and turns API requests into engine requests and back:

1. `prepare` (in a worker thread: parsing, the chat template and tokenization stay off the event
   loop): validate the body (`protocol.py`), check the model id, render and tokenize the prompt,
   apply the limits (prompt length, `max_tokens`, context), map the sampling settings.
2. `submit`: register it with the loop; a full waiting queue is a 429 with ``Retry-After``, a dead
   loop a 503, and nothing is promised before the engine has accepted the request.
3. `complete` / `stream`: the reply, whole or as Server-Sent Events. Whatever ends the request
   (done, engine error, or the client going away, which cancels it and frees its slot at the next
   step), `_finish` logs one line, reports to the observer and captures the exchange: the
   assembled reply for streams too, input only when the reply was cut short.

The observer (Ray Serve metrics in `serve_apps/`) gets every finished or refused request, and the
loop's statistics every `stats_seconds`.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aerie.engine import EngineConfig, SamplingParams
from aerie.engine.build import build_engine
from aerie.engine.loop import EngineLoop, LoopDead, QueueFull, RequestHandle
from aerie.engine.request import RequestOutput
from aerie.formats.chat import ChatEncoder
from aerie.serving.capture import CaptureSink
from aerie.serving.config import ServeConfig
from aerie.serving.protocol import APIError, ChatRequest, CompletionRequest, Route, parse_request
from aerie.serving.records import CLIENT_CLOSED, Observer, RequestRecord
from aerie.serving.responses import ReplyFormat, sse
from aerie.target import load_target


@dataclass
class Job:
    """A request on its way through the service."""

    route: Route
    request: CompletionRequest | ChatRequest
    raw: bytes
    prompt_ids: list[int]
    params: SamplingParams
    reply: ReplyFormat
    capture: bool
    arrived: float = field(default_factory=time.perf_counter)
    handle: RequestHandle | None = None
    text: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    first_token_at: float | None = None
    finish_reason: str | None = None
    error: str | None = None

    @property
    def request_id(self) -> str:
        return self.reply.id

    @property
    def prompt_param(self) -> str:
        return "messages" if self.route == "chat" else "prompt"

    def record(self, output: RequestOutput) -> None:
        if output.new_token_ids and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.completion_tokens += len(output.new_token_ids)
        self.text.append(output.new_text)
        if output.finished:
            self.finish_reason = output.finish_reason
            self.error = output.error

    def full_reply(self) -> dict[str, Any]:
        return self.reply.full("".join(self.text), self.finish_reason or "stop", len(self.prompt_ids),
                               self.completion_tokens)


class OpenAIService:
    def __init__(
        self,
        config: ServeConfig,
        observer: Observer | None = None,
        log: logging.Logger | None = None,
        stats_seconds: float = 1.0,
    ) -> None:
        self.config = config
        self.model = config.resolved()
        self.log = log or logging.getLogger(__name__)
        self.observer = observer
        self.created = int(time.time())
        target = load_target(self.model.target)
        engine = build_engine(
            target, EngineConfig(max_slots=config.max_slots, max_len=config.max_len), self.model.method,
            self.model.head, self.model.k, tree=self.model.tree, lookup=self.model.lookup,
        )
        self.tokenizer = target.tokenizer
        self.vocab_size = engine.vocab_size
        self.encoder = ChatEncoder(self.tokenizer) if getattr(self.tokenizer, "chat_template", None) else None
        self._tokenizer_lock = threading.Lock()
        self.loop = EngineLoop(engine, max_waiting=config.max_waiting)
        self.capture = CaptureSink(config.capture, self.log) if config.capture is not None else None
        self._closing = threading.Event()
        self._stats_thread = None
        if observer is not None:
            self._stats_thread = threading.Thread(target=self._report_stats, args=(stats_seconds,),
                                                  name="aerie-serve-stats", daemon=True)
            self._stats_thread.start()
        self.log.info("serving %s: target %s, method %s%s, head %s, k %s, %d slots", self.model.served_model,
                      self.model.target, self.model.method, "+lookup" if self.model.lookup else "", self.model.head,
                      self.model.k, config.max_slots)

    # ---- checks ---------------------------------------------------------------------------------

    def authorize(self, authorization: str | None) -> None:
        """`Authorization: Bearer <key>`, compared in constant time, when a key is configured."""
        key = self.config.api_key
        if key is None:
            return
        if not authorization:
            raise APIError(401, "You didn't provide an API key: send `Authorization: Bearer <key>`.",
                           code="missing_api_key")
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    def check_health(self) -> None:
        """Raises when the replica cannot serve: the engine loop (or the capture flusher) is dead."""
        if not self.loop.alive:
            raise RuntimeError(f"the engine loop is dead: {self.loop.failure!r}")
        if self.capture is not None and not self.capture.alive:
            raise RuntimeError("the capture flusher thread is dead")

    # ---- requests -------------------------------------------------------------------------------

    def prepare(self, route: Route, raw: bytes) -> Job:
        """Validate and tokenize a request body; `APIError` for anything this server will not run."""
        request = parse_request(route, raw)
        if request.model != self.model.served_model:
            raise APIError(404, f"The model `{request.model}` does not exist (this endpoint serves "
                           f"`{self.model.served_model}`).", param="model", code="model_not_found")
        param = "messages" if route == "chat" else "prompt"
        with self._tokenizer_lock:
            prompt_ids = self._prompt_ids(request, param)
        limit, max_len = self.config.prompt_limit, self.config.max_len
        if len(prompt_ids) > limit:
            raise APIError(400, f"{param}: the prompt is {len(prompt_ids)} tokens; this endpoint accepts at "
                           f"most {limit}.", param=param, code="context_length_exceeded")
        max_tokens, max_field = request.requested_max_tokens
        if max_tokens is None:
            max_tokens = min(self.config.max_tokens_limit, max_len - len(prompt_ids))
        elif max_tokens > self.config.max_tokens_limit:
            raise APIError(400, f"{max_field}: at most {self.config.max_tokens_limit} on this endpoint, got "
                           f"{max_tokens}.", param=max_field)
        if len(prompt_ids) + max_tokens > max_len:
            raise APIError(400, f"This model's maximum context length is {max_len} tokens. However, you "
                           f"requested {len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the "
                           f"{param}, {max_tokens} in the completion).", param=param,
                           code="context_length_exceeded")
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if request.temperature is None else request.temperature,
                top_p=1.0 if request.top_p is None else request.top_p,
                seed=request.seed,
                stop=request.stops,
            )
        except ValueError as error:
            raise APIError(400, str(error), param=str(error).split(" ", 1)[0]) from None
        reply = ReplyFormat(route, self.model.served_model, include_usage=request.include_usage)
        capture = self.capture is not None and self.capture.sampled()
        return Job(route, request, raw, prompt_ids, params, reply, capture)

    def _prompt_ids(self, request: CompletionRequest | ChatRequest, param: str) -> list[int]:
        if isinstance(request, ChatRequest):
            if self.encoder is None:
                raise APIError(400, "messages: this model has no chat template; use /v1/completions",
                               param="messages")
            try:
                text = self.encoder.render(request.template_messages(), add_generation_prompt=True)
            except Exception as error:  # noqa: BLE001 - a template error is the request's problem
                raise APIError(400, f"messages: the chat template failed on them: {error}", param="messages") \
                    from None
        elif isinstance(request.prompt, str):
            text = request.prompt
        else:
            for index, token in enumerate(request.prompt):
                if not 0 <= token < self.vocab_size:
                    raise APIError(400, f"prompt: token {token} at index {index} is not a token id in "
                                   f"[0, {self.vocab_size})", param="prompt")
            return list(request.prompt)
        prompt_ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not prompt_ids:
            raise APIError(400, f"{param}: the prompt is empty", param=param)
        return prompt_ids

    async def submit(self, job: Job) -> None:
        """Hand the request to the engine loop; refused requests raise `APIError`."""
        try:
            job.handle = await self.loop.submit_async(job.prompt_ids, job.params, job.request_id)
        except QueueFull:
            seconds = self.config.retry_after_s
            raise APIError(429, f"The endpoint is at capacity ({self.config.max_slots} sequences running, "
                           f"{self.config.max_waiting} waiting); retry after {seconds} s.", type="requests",
                           code="rate_limit_exceeded", headers={"Retry-After": str(seconds)}) from None
        except LoopDead as error:
            raise APIError(503, f"The engine is not running ({error}); the replica is being restarted.",
                           type="server_error", code="engine_unavailable") from None
        except ValueError as error:
            raise APIError(400, str(error), param=job.prompt_param) from None

    async def complete(self, job: Job) -> dict[str, Any]:
        """The whole reply (`stream: false`)."""
        try:
            async for _ in self._outputs(job):
                pass
        finally:
            self._finish(job)
        if job.error is not None:
            raise APIError(500, f"The engine failed on this request: {job.error}", type="server_error")
        return job.full_reply()

    async def stream(self, job: Job) -> AsyncIterator[str]:
        """Server-Sent Events: the reply's text as the engine produces it, then usage and [DONE]."""
        try:
            for chunk in job.reply.opening():
                yield chunk
            async for output in self._outputs(job):
                if output.error is not None:
                    error = APIError(500, f"The engine failed on this request: {output.error}", type="server_error")
                    yield sse(error.body())
                elif output.new_text or output.finished:
                    yield job.reply.delta(output.new_text, output.finish_reason if output.finished else None)
            for chunk in job.reply.closing(len(job.prompt_ids), job.completion_tokens):
                yield chunk
        finally:
            self._finish(job)

    async def _outputs(self, job: Job) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for a job, recorded on it; a loop that dies ends the job with an error."""
        try:
            async for output in job.handle:
                job.record(output)
                yield output
        except LoopDead as error:
            output = RequestOutput(job.request_id, [], "", finished=True, finish_reason="error", error=str(error))
            job.record(output)
            yield output

    def _finish(self, job: Job) -> None:
        """Cancel what is still running (the client went away), then log, observe and capture."""
        if job.finish_reason is None:
            self.loop.cancel(job.handle)
            job.finish_reason = "abort"
        status = CLIENT_CLOSED if job.finish_reason == "abort" else 500 if job.error else 200
        now = time.perf_counter()
        record = RequestRecord(
            request_id=job.request_id, route=job.route, status=status, prompt_tokens=len(job.prompt_ids),
            completion_tokens=job.completion_tokens, finish_reason=job.finish_reason,
            ttft_s=None if job.first_token_at is None else job.first_token_at - job.arrived,
            e2e_s=now - job.arrived, spec=job.handle.spec, detail=job.error or "",
        )
        self._report(record)
        if job.capture:
            body = job.raw.decode("utf-8")
            self.capture.add(body, job.full_reply() if status == 200 else None, inference_id=job.request_id)

    def rejected(self, route: str, error: APIError) -> None:
        """A request refused before it reached the engine (4xx, 429, 503)."""
        self._report(RequestRecord(request_id="-", route=route, status=error.status, detail=error.message))

    def _report(self, record: RequestRecord) -> None:
        self.log.info(record.log_line())
        if self.observer is not None:
            self.observer.request_done(record)

    # ---- information ----------------------------------------------------------------------------

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": self.model.served_model, "object": "model", "created": self.created, "owned_by": "aerie",
            "root": self.model.target, "max_model_len": self.config.max_len,
        }]}

    def stats(self) -> dict[str, Any]:
        """The replica's live numbers (what the metrics export), for operators and tests."""
        stats = self.loop.stats()
        spec = stats.spec
        capture = self.capture
        return {
            "model": self.model.served_model, "method": self.model.method, "k": self.model.k,
            "alive": self.loop.alive, "running": stats.running, "waiting": stats.waiting, "steps": stats.steps,
            "decode_steps": stats.decode_steps, "decode_rows": stats.decode_rows,
            "decode_tokens": stats.decode_tokens, "k_histogram": {str(k): n for k, n in stats.k_histogram.items()},
            "spec_decode": {
                "num_drafts": spec.drafts, "num_draft_tokens": spec.draft_tokens,
                "num_accepted_tokens": spec.accepted_tokens, "num_accepted_tokens_per_pos": spec.accepted_per_position,
                "acceptance_length": spec.acceptance_length,
            },
            "capture": None if capture is None else {
                "uri": capture.config.uri, "captured": capture.captured, "written": capture.written,
                "dropped": capture.dropped, "failed_flushes": capture.failed_flushes,
            },
        }

    def _report_stats(self, seconds: float) -> None:
        while not self._closing.wait(seconds):
            self.observer.engine_stats(self.loop.stats())

    def close(self) -> None:
        """Stop the engine loop and write the captured traffic that is still buffered."""
        self._closing.set()
        self.loop.stop()
        if self._stats_thread is not None:
            self._stats_thread.join(timeout=10)
            self.observer.engine_stats(self.loop.stats())
        if self.capture is not None:
            self.capture.close()
