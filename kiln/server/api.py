"""The FastAPI app: OpenAI routes, /health, /metrics, API-key check, error handlers, engine lifespan."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kiln import __version__
from kiln.engine.async_engine import AsyncEngine
from kiln.server.errors import APIError, install_error_handlers
from kiln.server.metrics import HTTPMetricsMiddleware, ServerMetrics
from kiln.server.protocol import ChatCompletionRequest, CompletionRequest
from kiln.server.serving import OpenAIServing


@dataclass(frozen=True)
class AppSettings:
    served_model_name: str
    model_aliases: tuple[str, ...] = ()  # other names clients may use for the model (e.g. the --model value)
    api_key: str | None = None  # None: no authentication


def create_app(engine: AsyncEngine, settings: AppSettings) -> FastAPI:
    """The app owns the engine loop: the lifespan starts it and, on shutdown, aborts what is left and joins it."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await engine.stop()

    app = FastAPI(title="kiln", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    metrics = ServerMetrics(engine)
    serving = OpenAIServing(engine, metrics, settings.served_model_name, settings.model_aliases)
    app.state.engine, app.state.metrics, app.state.serving = engine, metrics, serving
    app.add_middleware(HTTPMetricsMiddleware, metrics=metrics)
    install_error_handlers(app)
    authorized = [Depends(_api_key_check(settings.api_key))]

    @app.get("/health")
    async def health() -> JSONResponse:
        stats = engine.stats()
        body: dict[str, Any] = {
            "status": "ok" if engine.is_accepting else "unavailable",
            "model": settings.served_model_name,
            "num_requests_running": stats.num_running,
            "num_requests_waiting": stats.num_waiting,
            "num_requests_unfinished": engine.num_unfinished,
            "kv_cache_used_blocks": stats.num_kv_blocks_used,
            "kv_cache_total_blocks": stats.num_kv_blocks,
        }
        return JSONResponse(body, status_code=200 if engine.is_accepting else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=authorized)
    async def models() -> dict[str, Any]:
        return serving.models()

    @app.post("/v1/completions", dependencies=authorized)
    async def completions(request: Request, body: CompletionRequest) -> Response:
        return await serving.completions(request, body)

    @app.post("/v1/chat/completions", dependencies=authorized)
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        return await serving.chat(request, body)

    return app


def _api_key_check(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    """A FastAPI dependency: 401 unless `Authorization: Bearer <api_key>` matches (constant-time compare)."""

    async def check(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            found = "no Authorization header" if not header else "a key that does not match"
            raise APIError(
                401,
                f"invalid API key: expected 'Authorization: Bearer <key>' with the server's --api-key, got {found}",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return check
