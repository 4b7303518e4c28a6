"""Parsers of `kiln serve` and `kiln loadtest` (handlers: kiln.server.launcher, kiln.bench.loadtest); the serve
flags come from `EngineArgs` and `ServerArgs` (kiln.server.server_args)."""

from __future__ import annotations

import argparse

from kiln.engine.setup.args import EngineArgs
from kiln.server.server_args import ServerArgs


def add_serve_subcommand(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    EngineArgs.add_cli_args(p)
    ServerArgs.add_cli_args(p)
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
    p.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="words of one prefix every prompt starts with (with --turns, the chats' system message): the "
        "traffic of one system prompt, for prefix caching",
    )
    p.add_argument(
        "--turns",
        type=int,
        default=1,
        help="multi-turn chats of this many turns on /v1/chat/completions, each turn sending the conversation so "
        "far with its answers (--num-requests counts turns; --concurrency counts chats)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="stop sending and cancel what is left after this")
    p.add_argument("--seed", type=int, default=0, help="seed for lengths, prompts and arrivals")
    p.add_argument("--json", default=None, help="write the report (and every request's record) here")
    p.add_argument("--plot", default=None, help="write a PNG of latency percentiles over time here")
    p.set_defaults(handler="kiln.bench.commands:run_loadtest_command")
