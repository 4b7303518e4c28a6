"""The FastAPI app: OpenAI routes (completions, chat, embeddings), vLLM's tokenizer routes, /health, /metrics, the
middleware stack, error handlers, engine lifespan."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kiln import __version__
from kiln.engine.serving.async_engine import AsyncEngine
from kiln.server.adapters import LoadAdapterRequest, UnloadAdapterRequest, load_adapter, unload_adapter
from kiln.server.connection_table import ConnectionTable
from kiln.server.embeddings import EmbeddingEndpoint, EmbeddingRequest
from kiln.server.errors import install_error_handlers
from kiln.server.grammar_limits import GRAMMAR_COMPILE_THREADS, GrammarLimits
from kiln.server.limits import ServerLimits
from kiln.server.metrics import HTTPMetricsMiddleware, ServerMetrics
from kiln.server.middleware import (
    APIKeyMiddleware,
    BodySizeLimitMiddleware,
    HostCheckMiddleware,
    RequestIdMiddleware,
)
from kiln.server.protocol import ChatCompletionRequest, CompletionRequest
from kiln.server.serving import OpenAIServing
from kiln.server.tokenization import DetokenizeRequest, TokenizerEndpoints, parse_tokenize_request


@dataclass(frozen=True)
class AppSettings:
    served_model_name: str
    model_aliases: tuple[str, ...] = ()  # other names clients may use for the model (e.g. the --model value)
    api_key: str | None = None  # None: no authentication
    metrics_auth: bool = False  # /metrics requires the API key too
    limits: ServerLimits | None = None  # None: ServerLimits.for_model(the engine's max_model_len)
    allowed_hosts: frozenset[str] = frozenset()  # Host names answered without a key, beyond IPs and localhost
    parse_special_tokens: bool = True  # /v1/completions text prompts: special-token text becomes control tokens
    tool_call_parser: str | None = None  # None: chosen by the chat template (kiln.server.tool_parsers)
    reasoning_parser: str | None = None  # None: chosen by the chat template; "none": off (kiln.server.reasoning)
    grammar_limits: GrammarLimits = field(default_factory=GrammarLimits)  # structured outputs' size and deadline
    grammar_compile_threads: int = GRAMMAR_COMPILE_THREADS
    runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter allowed


def create_app(engine: AsyncEngine, settings: AppSettings, connections: ConnectionTable | None = None) -> FastAPI:
    """The app owns the engine loop: the lifespan starts it and, on shutdown, aborts what is left and joins it.
    `connections`: the server's open connections (kiln.server.connection_table), counted in /metrics."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            app.state.is_shutting_down = True
            await engine.stop()
            serving.close()

    app = FastAPI(title="kiln", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    limits = settings.limits or ServerLimits.for_model(engine.core.max_model_len)
    metrics = ServerMetrics(engine, connections)
    serving = OpenAIServing(
        engine,
        metrics,
        limits,
        settings.served_model_name,
        aliases=settings.model_aliases,
        parse_special_tokens=settings.parse_special_tokens,
        tool_call_parser=settings.tool_call_parser,
        grammar_limits=settings.grammar_limits,
        grammar_compile_threads=settings.grammar_compile_threads,
        reasoning_parser=settings.reasoning_parser,
    )
    app.state.engine, app.state.metrics, app.state.serving = engine, metrics, serving
    app.state.settings, app.state.connections = settings, connections
    app.state.is_shutting_down = False
    _add_middleware(app, settings, limits, metrics)
    install_error_handlers(app)
    _add_server_routes(app, engine, settings, metrics)
    _add_openai_routes(app, serving)
    _add_adapter_routes(app, engine, settings)
    _add_tokenizer_routes(app, serving)
    return app


def _add_middleware(app: FastAPI, settings: AppSettings, limits: ServerLimits, metrics: ServerMetrics) -> None:
    # NOTE: the last one added runs first; kiln/server/middleware.py explains the order.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=limits.max_body_bytes, timeout_s=limits.body_timeout_s)
    if settings.api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key, protect_metrics=settings.metrics_auth)
    else:
        app.add_middleware(HostCheckMiddleware, allowed=settings.allowed_hosts)
    app.add_middleware(HTTPMetricsMiddleware, metrics=metrics)
    app.add_middleware(RequestIdMiddleware)


def _unavailable_reason(app: FastAPI, engine: AsyncEngine) -> str | None:
    """Why the server answers no request now (None: it does)."""
    if engine.is_healthy:
        return None
    if app.state.is_shutting_down:
        return "the server is shutting down and accepts no new requests"
    return "the engine loop has stopped, so no request can be served (the server log says why); restart the server"


def _add_server_routes(app: FastAPI, engine: AsyncEngine, settings: AppSettings, metrics: ServerMetrics) -> None:
    """/health, /metrics and /reset_prefix_cache: the server's own routes."""

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> JSONResponse:
        stats = engine.stats()
        reason = _unavailable_reason(app, engine)
        body: dict[str, Any] = {
            "status": "ok" if reason is None else "unavailable",
            "model": settings.served_model_name,
            "num_requests_running": stats.num_running,
            "num_requests_waiting": stats.num_waiting,
            "num_requests_unfinished": engine.num_unfinished,
            "kv_cache_used_blocks": stats.num_kv_blocks_used,
            "kv_cache_total_blocks": stats.num_kv_blocks,
            "prefix_caching": stats.prefix_caching,
            "prefix_cache_hit_rate": round(stats.prefix_cache_hit_rate, 4),
            "speculative_decoding": stats.speculative,
        }
        if reason is not None:
            body["reason"] = reason
        return JSONResponse(body, status_code=200 if reason is None else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, Any]:
        """Drop every cached KV block no request holds (as vLLM and SGLang); behind the API key when one is set."""
        if not engine.stats().prefix_caching:
            return {"prefix_caching": False, "dropped_blocks": 0}
        return {"prefix_caching": True, "dropped_blocks": await engine.reset_prefix_cache()}


def _add_adapter_routes(app: FastAPI, engine: AsyncEngine, settings: AppSettings) -> None:
    """vLLM's runtime LoRA routes: /v1/load_lora_adapter and /v1/unload_lora_adapter (kiln.server.adapters)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadAdapterRequest) -> dict[str, Any]:
        return await load_adapter(engine, body, settings.runtime_lora_updating)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadAdapterRequest) -> dict[str, Any]:
        return await unload_adapter(engine, body, settings.runtime_lora_updating)


def _add_openai_routes(app: FastAPI, serving: OpenAIServing) -> None:
    """OpenAI's routes: /v1/models, /v1/completions, /v1/chat/completions, /v1/embeddings."""

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return serving.models()

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        return await serving.completions(request, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        return await serving.chat(request, body)

    embedding = EmbeddingEndpoint(serving)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request, body: EmbeddingRequest) -> Response:
        return await embedding.embeddings(request, body)


def _add_tokenizer_routes(app: FastAPI, serving: OpenAIServing) -> None:
    """vLLM's tokenizer routes: /tokenize, /detokenize, /tokenizer_info."""
    tokenization = TokenizerEndpoints(serving)

    @app.post("/tokenize")
    async def tokenize(body: dict[str, Any]) -> dict[str, Any]:
        return await tokenization.tokenize(parse_tokenize_request(body))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return await tokenization.detokenize(body)

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return tokenization.tokenizer_info()
