"""Parsers of `kiln serve` and `kiln loadtest` (handlers: kiln.server.launcher, kiln.bench.loadtest)."""

from __future__ import annotations

import argparse

from kiln.engine.args import EngineArgs


def add_server_args(p: argparse.ArgumentParser) -> None:
    """Serving options shared by `kiln serve` and `python -m kiln.launch`.

    Engine options (model, KV cache, batching, --recipe, graph mode, --seed) come from `EngineArgs`.
    """
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (0: any free port, shown in the Ready line)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* routes")
    p.add_argument(
        "--max-queue",
        type=int,
        default=None,
        help="requests allowed to wait beyond --max-num-seqs; more are answered 429 (default: unbounded)",
    )
    p.add_argument("--served-model-name", default=None, help="model id clients see (default: checkpoint file name)")
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGINT/SIGTERM before they are aborted",
    )
    p.add_argument("--access-log", action="store_true", help="log one line per HTTP request")


def add_serve_subcommand(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    EngineArgs.add_cli_args(p)
    add_server_args(p)
    p.set_defaults(handler="kiln.server.launcher:run_server")


def add_loadtest_subcommand(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("loadtest", help="dynamic-batch load test against a local kiln (or OpenAI) server")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (loopback only)")
    p.add_argument("--model", default=None, help="model id to request (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--concurrency", type=int, default=8, help="most requests in flight at once")
    p.add_argument("--num-requests", type=int, default=64, help="requests to send in total")
    p.add_argument("--input-len", default="32:256", help="prompt length range in tokens, A:B (uniform)")
    p.add_argument("--output-len", default="16:128", help="output length range in tokens, A:B (uniform)")
    p.add_argument("--request-rate", type=float, default=None, help="Poisson arrival rate, req/s (default: no gaps)")
    p.add_argument("--timeout", type=float, default=600.0, help="stop sending and cancel what is left after this")
    p.add_argument("--seed", type=int, default=0, help="seed for lengths, prompts and arrivals")
    p.add_argument("--json", default=None, help="write the report (and every request's record) here")
    p.add_argument("--plot", default=None, help="write a PNG of latency percentiles over time here")
    p.set_defaults(handler="kiln.bench.loadtest:run_loadtest_command")
