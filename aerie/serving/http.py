"""The HTTP face of `OpenAIService`: a FastAPI app with OpenAI's routes and error shape.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream: true``), ``GET /health`` (no key needed; 503 when the engine loop is dead) and
``GET /stats`` (the replica's live numbers). Every error, including unknown routes and methods,
is answered as ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from aerie.serving.protocol import APIError, Route
from aerie.serving.service import OpenAIService

log = logging.getLogger(__name__)


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def create_app(service: OpenAIService) -> FastAPI:
    app = FastAPI(title="aerie", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> JSONResponse:
        return error_response(APIError(error.status_code, str(error.detail), code=None))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, error: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return error_response(APIError(500, f"Internal error: {type(error).__name__}", type="server_error"))

    async def generate(request: Request, route: Route) -> Response:
        try:
            service.authorize(request.headers.get("authorization"))
            raw = await _body(request, service.config.max_request_bytes)
            job = await asyncio.to_thread(service.prepare, route, raw)
            await service.submit(job)
        except APIError as error:
            service.rejected(route, error)
            return error_response(error)
        if job.request.stream:
            return StreamingResponse(service.stream(job), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": job.request_id})
        try:
            return JSONResponse(await service.complete(job), headers={"X-Request-Id": job.request_id})
        except APIError as error:
            return error_response(error)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, "chat")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            service.authorize(request.headers.get("authorization"))
        except APIError as error:
            return error_response(error)
        return JSONResponse(service.models())

    @app.get("/health")
    async def health() -> Response:
        try:
            service.check_health()
        except RuntimeError as error:
            return error_response(APIError(503, str(error), type="server_error", code="unhealthy"))
        return JSONResponse({"status": "ok"})

    @app.get("/stats")
    async def stats(request: Request) -> Response:
        try:
            service.authorize(request.headers.get("authorization"))
        except APIError as error:
            return error_response(error)
        return JSONResponse(service.stats())

    return app


async def _body(request: Request, limit: int) -> bytes:
    """The request body, refused (413) beyond `limit` bytes before it is all read."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"The request body is {declared} bytes; the limit is {limit}.", code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"The request body is over the limit of {limit} bytes.", code="request_too_large")
    return bytes(body)
