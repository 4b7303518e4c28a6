"""Prometheus metrics on a per-app registry: HTTP requests by status, latency histograms, engine and graph state.

Engine gauges are read from the engine's published snapshot at scrape time; graph counters from
`engine.core.runner.counters` when graph mode provides them (0 otherwise, so dashboards need no special case).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kiln.engine.request import RequestOutput
from kiln.engine.serving.async_engine import AsyncEngine
from kiln.server.connection_table import ConnectionTable
from kiln.server.errors import CLIENT_CLOSED

ENDPOINTS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/v1/embeddings",
    "/tokenize",
    "/detokenize",
    "/tokenizer_info",
    "/health",
    "/metrics",
)
# NOTE: CPU latencies run from milliseconds to minutes, so the buckets span both.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
GRAPH_COUNTERS = ("replays", "dynamic_fallbacks")


class EngineCollector(Collector):
    """Gauges for running/waiting requests and the KV cache, counters for preemptions and graph replays."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats()
        gauges = [
            ("kiln_num_requests_running", "Requests in the running batch", s.num_running),
            ("kiln_num_requests_waiting", "Requests waiting for a batch slot or KV blocks", s.num_waiting),
            (
                "kiln_num_requests_unfinished",
                "Requests admitted by the server and not finished",
                self.engine.num_unfinished,
            ),
            ("kiln_kv_cache_used_blocks", "KV cache blocks in use", s.num_kv_blocks_used),
            ("kiln_kv_cache_total_blocks", "KV cache blocks in the pool", s.num_kv_blocks),
            (
                "kiln_kv_cache_free_blocks",
                "KV cache blocks free (a leak shows as fewer when idle)",
                s.num_kv_blocks - s.num_kv_blocks_used,
            ),
            (
                "kiln_kv_cache_usage_ratio",
                "Fraction of KV cache blocks in use (0-1)",
                s.num_kv_blocks_used / max(s.num_kv_blocks, 1),
            ),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("kiln_num_preemptions", "Requests preempted for KV blocks", value=s.num_preemptions)
        yield CounterMetricFamily(
            "kiln_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", value=s.prefix_cache_queries
        )
        yield CounterMetricFamily(
            "kiln_prefix_cache_hits", "Prompt tokens found in the prefix cache", value=s.prefix_cache_hits
        )
        yield from _speculative_metrics(s.speculative or {})
        yield CounterMetricFamily("kiln_engine_steps", "Engine steps run", value=s.num_steps)
        yield CounterMetricFamily("kiln_engine_step_failures", "Engine steps that raised", value=s.num_step_failures)
        yield from self._graph_metrics()

    def _graph_metrics(self) -> Iterator[Metric]:
        counters = getattr(self.engine.core.runner, "counters", None)
        for name in GRAPH_COUNTERS:
            value = getattr(counters, name, 0) if counters is not None else 0
            doc = f"Graph mode: {name.replace('_', ' ')} (0 when graph mode is off)"
            yield CounterMetricFamily(f"kiln_graph_{name}", doc, value=value)
        if counters is None or not dataclasses.is_dataclass(counters):
            return
        for f in dataclasses.fields(counters):
            value = getattr(counters, f.name)
            if f.name not in GRAPH_COUNTERS and isinstance(value, int | float) and not isinstance(value, bool):
                yield GaugeMetricFamily(f"kiln_graph_{f.name}", f"Graph mode counter {f.name}", value=value)


SPEC_COUNTERS = {  # vLLM's spec_decode metrics; each verification also emits the target's own token
    "num_drafts": "Speculative decoding: verifications (a sequence's draft tokens checked in one step)",
    "num_draft_tokens": "Speculative decoding: draft tokens proposed and verified",
    "num_accepted_tokens": "Speculative decoding: draft tokens the target accepted",
    "num_emitted_tokens": "Speculative decoding: tokens verifications emitted (accepted drafts + the target's own)",
}


def _speculative_metrics(stats: dict[str, float | int]) -> Iterator[Metric]:
    """Speculative decoding's counters (0 when it is off) and its mean acceptance length."""
    for name, doc in SPEC_COUNTERS.items():
        yield CounterMetricFamily(f"kiln_spec_decode_{name}", doc, value=stats.get(name, 0))
    doc = "Speculative decoding: tokens emitted per verification (1 + accepted drafts; 0 before any)"
    yield GaugeMetricFamily(
        "kiln_spec_decode_mean_acceptance_length", doc, value=stats.get("mean_acceptance_length", 0)
    )


class ConnectionCollector(Collector):
    """The server's open and idle connections, the new ones it refused (by reason) and the idle ones it closed for
    room (kiln.server.connection_table): these never reach the app, so kiln_http_requests cannot count them."""

    def __init__(self, connections: ConnectionTable) -> None:
        self.connections = connections

    def collect(self) -> Iterator[Metric]:
        c = self.connections
        yield GaugeMetricFamily("kiln_connections_open", "Open HTTP connections", value=len(c))
        yield GaugeMetricFamily("kiln_connections_idle", "Open connections awaiting a request", value=c.num_idle)
        refused = CounterMetricFamily(
            "kiln_connections_refused",
            "New connections answered 503 because every connection of the limit had a request in flight",
            labels=["reason"],
        )
        for reason in ("max_connections", "max_connections_per_peer"):
            refused.add_metric([reason], c.num_refused[reason])
        yield refused
        doc = "Idle connections (no request in flight) closed to make room for a new one"
        yield CounterMetricFamily("kiln_connections_closed_idle", doc, value=c.num_closed_idle)


# adapters loaded at run time could grow a label set without end: the first this many keep their names
MAX_ADAPTER_LABELS = 64
OTHER_ADAPTERS = "other"


class ServerMetrics:
    def __init__(self, engine: AsyncEngine, connections: ConnectionTable | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.http_requests = Counter(
            "kiln_http_requests", "HTTP requests by endpoint and status code", ["endpoint", "status"], registry=r
        )
        self.client_disconnects = Counter(
            "kiln_client_disconnects",
            "HTTP requests whose client went away before the response was complete (during the upload, the "
            "generation or the stream); counted apart from server errors, and answered 499 in kiln_http_requests",
            ["endpoint"],
            registry=r,
        )
        self.finished = Counter(
            "kiln_request_finished", "Engine requests finished, by reason", ["finish_reason"], registry=r
        )
        self.prompt_tokens = Counter("kiln_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("kiln_generation_tokens", "Tokens generated by finished requests", registry=r)
        # per LoRA adapter (kiln.server.adapters), a bounded label set: past MAX_ADAPTER_LABELS names, "other"
        self.adapter_requests = Counter(
            "kiln_lora_requests", "Engine requests finished with a LoRA adapter, by adapter", ["adapter"], registry=r
        )
        self.adapter_tokens = Counter(
            "kiln_lora_generation_tokens", "Tokens generated with a LoRA adapter, by adapter", ["adapter"], registry=r
        )
        self.adapter_labels: set[str] = set()
        self.ttft = Histogram(
            "kiln_time_to_first_token_seconds",
            "From HTTP arrival to the first output token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "kiln_time_per_output_token_seconds",
            "Mean time between output tokens of a request",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "kiln_e2e_request_latency_seconds", "From HTTP arrival to the last token", buckets=E2E_BUCKETS, registry=r
        )
        r.register(EngineCollector(engine))
        if connections is not None:
            r.register(ConnectionCollector(connections))

    def observe_finished(self, out: RequestOutput, arrival_time: float) -> None:
        """Record a finished request; `arrival_time` is time.monotonic() when its HTTP request arrived."""
        self.finished.labels(finish_reason=out.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(len(out.token_ids))
        if out.lora_name is not None:
            label = self._adapter_label(out.lora_name)
            self.adapter_requests.labels(adapter=label).inc()
            self.adapter_tokens.labels(adapter=label).inc(len(out.token_ids))
        m = out.metrics
        if m.first_token_time is not None:
            self.ttft.observe(max(m.first_token_time - arrival_time, 0.0))
            if m.finished_time is not None and len(out.token_ids) > 1:
                self.tpot.observe(max(m.finished_time - m.first_token_time, 0.0) / (len(out.token_ids) - 1))
        if m.finished_time is not None and out.finish_reason in ("stop", "length"):
            self.e2e.observe(max(m.finished_time - arrival_time, 0.0))

    def _adapter_label(self, name: str) -> str:
        if name not in self.adapter_labels and len(self.adapter_labels) >= MAX_ADAPTER_LABELS:
            return OTHER_ADAPTERS
        self.adapter_labels.add(name)
        return name

    def render(self) -> bytes:
        return generate_latest(self.registry)


class HTTPMetricsMiddleware:
    """Counts every HTTP request by endpoint (known routes, else "other") and the status code it was answered with."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: int | None = None
        complete = disconnected = False

        async def receive_and_watch() -> Message:
            nonlocal disconnected
            message = await receive()
            disconnected = disconnected or message["type"] == "http.disconnect"
            return message

        async def send_and_record_status(message: Message) -> None:
            nonlocal status, complete
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            await send(message)

        try:
            await self.app(scope, receive_and_watch, send_and_record_status)
        finally:
            endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
            # NOTE: a client that left before any answer (mid-upload, mid-generation) is a 499, never a 500
            left = status == CLIENT_CLOSED or (disconnected and not complete)
            if status is None:
                status = CLIENT_CLOSED if disconnected else 500
            if left:
                self.metrics.client_disconnects.labels(endpoint=endpoint).inc()
            self.metrics.http_requests.labels(endpoint=endpoint, status=str(status)).inc()
