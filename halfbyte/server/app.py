"""The OpenAI-compatible HTTP server: FastAPI app over one AsyncLLM.

Errors are OpenAI error objects: 400 bad parameters or malformed JSON, 401 bad API key,
404 unknown model or route, 503 when the waiting queue is full (with Retry-After)."""

from __future__ import annotations

import hmac
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from halfbyte.async_llm import AsyncLLM, EngineDeadError, PromptInput, QueueFullError
from halfbyte.errors import HalfbyteError
from halfbyte.sampling_params import SamplingParams
from halfbyte.server.generation import (
    Responder,
    admit,
    chat_params,
    chat_prompt,
    completion_params,
    completion_prompts,
    merged,
)
from halfbyte.server.logprobs import LogprobFormatter
from halfbyte.server.metrics import ServerMetrics
from halfbyte.server.protocol import ChatCompletionRequest, CompletionRequest, error_body, model_card
from halfbyte.server.sampling import requested_logprobs


class ModelNotServedError(HalfbyteError):
    """The request names a model this server does not serve (HTTP 404)."""


def _error(status: int, message: str, type_: str, code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, code), status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> str:
    errors = exc.errors()
    if not errors:
        return "invalid request body"
    first = errors[0]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON"
    loc = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
    return f"{loc}: {first.get('msg', 'invalid value')}" if loc else str(first.get("msg", "invalid request body"))


class ApiKeyMiddleware:
    """401 for /v1/ requests without `Authorization: Bearer <key>` (plain ASGI: streams pass untouched)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and str(scope["path"]).startswith("/v1/"):
            auth = Headers(scope=scope).get("authorization", "")
            token = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), self.key):
                await _error(401, "invalid API key", "invalid_request_error", "invalid_api_key")(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(llm: AsyncLLM, model_name: str, api_key: str | None = None, own_engine: bool = True) -> FastAPI:
    """own_engine: start the engine loop with the app and stop it (and free the model) at shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if own_engine:
            llm.start()
        try:
            yield
        finally:
            if own_engine:
                await llm.stop()

    app = FastAPI(title="halfbyte", lifespan=lifespan)
    metrics = ServerMetrics(llm)
    created = int(time.time())

    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, _validation_message(exc), "invalid_request_error")

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return _error(exc.status_code, str(exc.detail), "invalid_request_error", code)

    @app.exception_handler(QueueFullError)
    async def on_queue_full(request: Request, exc: QueueFullError) -> JSONResponse:
        return _error(503, str(exc), "server_overloaded", "queue_full", headers={"Retry-After": "1"})

    @app.exception_handler(ModelNotServedError)
    async def on_unknown_model(request: Request, exc: ModelNotServedError) -> JSONResponse:
        return _error(404, str(exc), "invalid_request_error", "model_not_found")

    @app.exception_handler(HalfbyteError)
    async def on_bad_input(request: Request, exc: HalfbyteError) -> JSONResponse:
        return _error(400, str(exc), "invalid_request_error")

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return _error(503, str(exc), "server_error", "engine_unavailable")

    # --- routes ---------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if not llm.is_running:
            return _error(503, "the engine is not running", "server_error", "engine_unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(model_name, created)]}

    async def serve(
        endpoint: str, req: ChatCompletionRequest | CompletionRequest, prompts: list[PromptInput],
        params: SamplingParams, responder: Responder,
    ) -> Response:
        try:
            if req.model != model_name:
                raise ModelNotServedError(f"the model {req.model!r} does not exist; this server serves {model_name!r}")
            choices = await admit(llm, prompts, params, req.n, metrics)
        except QueueFullError:
            metrics.requests.labels(endpoint, "rejected").inc()
            raise
        except Exception:
            metrics.requests.labels(endpoint, "error").inc()
            raise
        metrics.requests.labels(endpoint, "ok").inc()
        if req.stream:
            return StreamingResponse(
                responder.sse(choices, metrics), media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            async for _ in merged(choices, metrics):
                pass
        finally:
            choices.abort_all()
        return JSONResponse(responder.body(choices))

    def formatter(req: ChatCompletionRequest | CompletionRequest) -> LogprobFormatter | None:
        top_n = requested_logprobs(req)
        return None if top_n is None else LogprobFormatter(llm.tokenizer, top_n)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> Response:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await serve(
            "completions", req, completion_prompts(req), completion_params(req),
            Responder(chat=False, model=model_name, include_usage=include_usage, logprobs=formatter(req)),
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest) -> Response:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await serve(
            "chat", req, chat_prompt(req), chat_params(req),
            Responder(chat=True, model=model_name, include_usage=include_usage, logprobs=formatter(req)),
        )

    return app


def run_server(
    llm: AsyncLLM, model_name: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
    log_level: str = "info",
) -> None:
    import uvicorn

    app = create_app(llm, model_name, api_key)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
