"""Parsers of `kiln serve` and `kiln loadtest` (handlers: kiln.server.launcher, kiln.bench.loadtest)."""

from __future__ import annotations

import argparse

from kiln.engine.setup.arg_types import int_at_least
from kiln.engine.setup.args import EngineArgs
from kiln.server.grammar_limits import (
    GRAMMAR_COMPILE_THREADS,
    GRAMMAR_COMPILE_TIMEOUT_S,
    MAX_GRAMMAR_BYTES,
    MAX_GRAMMAR_CHOICES,
    MAX_SCHEMA_DEPTH,
)
from kiln.server.limits import (
    BODY_TIMEOUT_S,
    HEADER_TIMEOUT_S,
    KEEP_ALIVE_TIMEOUT_S,
    MAX_BODY_BYTES,
    MAX_CONNECTIONS,
    MAX_QUEUE,
    MAX_SEQS_PER_REQUEST,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STREAM_BUFFER,
    MIB,
    PROMPT_CHARS_PER_TOKEN,
)
from kiln.server.reasoning import REASONING_PARSERS
from kiln.server.tool_parsers import TOOL_PARSERS


def add_server_args(p: argparse.ArgumentParser) -> None:
    """Serving options shared by `kiln serve` and `python -m kiln.launch`.

    Engine options (model, KV cache, batching, --recipe, graph mode, --seed) come from `EngineArgs`.
    """
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument(
        "--allowed-hosts",
        default=None,
        metavar="NAMES",
        help="comma-separated Host names answered without an API key, beyond IP addresses and localhost ('*': "
        "any); other names get a 400, so a web page cannot reach the server by DNS rebinding",
    )
    p.add_argument("--port", type=int, default=8000, help="port to bind (0: any free port, shown in the Ready line)")
    p.add_argument("--served-model-name", default=None, help="model id clients see (default: checkpoint file name)")
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGINT/SIGTERM before they are aborted",
    )
    p.add_argument("--access-log", action="store_true", help="log one line per HTTP request")
    p.add_argument(
        "--completion-special-tokens",
        choices=("parse", "text"),
        default="parse",
        help="how /v1/completions tokenizes a text prompt: 'parse' turns special-token text such as <|im_start|> "
        "into control tokens, as vLLM does (a client may write a chat by hand); 'text' keeps it as characters, so "
        "a prompt built from untrusted text cannot forge turns (chat messages are always kept as text)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="how chat answers are read for tool calls (default: by the chat template's format; a template "
        "without tools gets kiln's fallback prompt and the hermes parser)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=[*sorted(REASONING_PARSERS), "none"],
        default=None,
        help="how chat answers are split into reasoning (message.reasoning_content, delta.reasoning_content) and "
        "the answer (content): qwen3 reads a <think>...</think> the model opens, deepseek_r1 one the template "
        "may have opened (everything before </think> is reasoning); none leaves answers whole (default: by the "
        "chat template: deepseek_r1 when its generation prompt opens <think>, qwen3 when it writes <think> "
        "elsewhere, none otherwise; the start-up log names it)",
    )

    p.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API key; needs --enable-lora)",
    )

    auth = p.add_argument_group(
        "authentication",
        "With an API key, /v1/* answers 401 unless the request has 'Authorization: Bearer KEY'; the key is checked "
        "before the body is read. The key comes from --api-key-file, --api-key or the KILN_API_KEY environment "
        "variable (a flag wins over the variable).",
    )
    auth.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="the API key; other users can read it in the process list (ps), so prefer --api-key-file or KILN_API_KEY",
    )
    auth.add_argument("--api-key-file", default=None, metavar="PATH", help="read the API key from this file (stripped)")
    auth.add_argument(
        "--metrics-auth", action="store_true", help="/metrics requires the API key too (default: open, like /health)"
    )

    limits = p.add_argument_group(
        "request limits",
        "Bounds on what one client can make the server do; a request over one is refused with the limit's name "
        "and value before the work starts.",
    )
    limits.add_argument(
        "--body-timeout",
        metavar="SECONDS",
        type=_seconds,
        default=BODY_TIMEOUT_S,
        help=f"time a request body may take to arrive; a stalled or trickled upload gets 408 and its connection is "
        f"closed (default: {BODY_TIMEOUT_S:g})",
    )
    limits.add_argument(
        "--header-timeout",
        metavar="SECONDS",
        type=_seconds,
        default=HEADER_TIMEOUT_S,
        help="time a request's line and headers may take to arrive, from the connection's opening or its previous "
        f"response; a connection that sends nothing or trickles headers gets 408 and is closed (default: "
        f"{HEADER_TIMEOUT_S:g})",
    )
    limits.add_argument(
        "--keep-alive-timeout",
        metavar="SECONDS",
        type=_seconds,
        default=KEEP_ALIVE_TIMEOUT_S,
        help=f"an idle kept-alive connection is closed after this (default: {KEEP_ALIVE_TIMEOUT_S:g})",
    )
    limits.add_argument(
        "--max-connections",
        metavar="N",
        type=int_at_least(1),
        default=MAX_CONNECTIONS,
        help="open connections at once; a new connection beyond them first closes the one idle longest (awaiting "
        "a request), and gets 503 only when every one has a request in flight (default: "
        f"{MAX_CONNECTIONS}; keep it under the process's file-descriptor limit, ulimit -n)",
    )
    limits.add_argument(
        "--max-connections-per-peer",
        metavar="N",
        type=int_at_least(1),
        default=None,
        help="open connections from one address at once, handled as --max-connections among its own (default: half "
        "of --max-connections)",
    )
    limits.add_argument(
        "--max-body-bytes",
        metavar="BYTES",
        type=int_at_least(1),
        default=MAX_BODY_BYTES,
        help=f"largest request body, checked before it is parsed; larger ones get 413 (default: {MAX_BODY_BYTES}, "
        f"{MAX_BODY_BYTES // MIB} MiB)",
    )
    limits.add_argument(
        "--max-prompt-chars",
        metavar="N",
        type=int_at_least(1),
        default=None,
        help="most characters in one prompt (a chat's messages together), checked before tokenizing, which holds "
        f"the GIL for ~1 s per million characters (default: {PROMPT_CHARS_PER_TOKEN} x --max-model-len, more than "
        "any prompt that fits needs)",
    )
    limits.add_argument(
        "--max-seqs-per-request",
        metavar="N",
        type=int_at_least(1),
        default=MAX_SEQS_PER_REQUEST,
        help=f"most completions one request may ask for: prompts x n (default: {MAX_SEQS_PER_REQUEST})",
    )
    limits.add_argument(
        "--max-stop-strings",
        metavar="N",
        type=int_at_least(0),
        default=MAX_STOP_STRINGS,
        help=f"most stop strings in one request; each is matched after every token (default: {MAX_STOP_STRINGS})",
    )
    limits.add_argument(
        "--max-stop-chars",
        metavar="N",
        type=int_at_least(1),
        default=MAX_STOP_CHARS,
        help=f"longest stop string, in characters (default: {MAX_STOP_CHARS})",
    )
    limits.add_argument(
        "--max-queue",
        metavar="N",
        type=int_at_least(0),
        default=MAX_QUEUE,
        help="completions (prompts x n) allowed to wait beyond --max-num-seqs; more are answered 429 with "
        f"Retry-After (default: {MAX_QUEUE})",
    )
    limits.add_argument(
        "--max-stream-buffer",
        metavar="N",
        type=int_at_least(1),
        default=MAX_STREAM_BUFFER,
        help="outputs (one per token per choice) a streaming response may hold that its client has not read; a "
        f"client further behind is cut off and its requests aborted (default: {MAX_STREAM_BUFFER})",
    )

    _add_grammar_args(p)


def _add_grammar_args(p: argparse.ArgumentParser) -> None:
    grammar = p.add_argument_group(
        "structured outputs",
        "Constraints (response_format, guided_*, tools) are checked against these limits before they are compiled, "
        "then compiled on their own threads, one at a time per client, so no request waits for another's grammar.",
    )
    grammar.add_argument(
        "--max-grammar-bytes",
        metavar="BYTES",
        type=int_at_least(1),
        default=MAX_GRAMMAR_BYTES,
        help=f"largest constraint (a schema as JSON, a regex, a grammar, a choice list) (default: {MAX_GRAMMAR_BYTES})",
    )
    grammar.add_argument(
        "--max-grammar-choices",
        metavar="N",
        type=int_at_least(1),
        default=MAX_GRAMMAR_CHOICES,
        help="most strings of a choice list, and most enum values and anyOf/oneOf branches of a schema (default: "
        f"{MAX_GRAMMAR_CHOICES})",
    )
    grammar.add_argument(
        "--max-schema-depth",
        metavar="N",
        type=int_at_least(1),
        default=MAX_SCHEMA_DEPTH,
        help=f"deepest nesting of a JSON schema's objects and lists (default: {MAX_SCHEMA_DEPTH})",
    )
    grammar.add_argument(
        "--grammar-compile-timeout",
        metavar="SECONDS",
        type=_seconds,
        default=GRAMMAR_COMPILE_TIMEOUT_S,
        help="a constraint not compiled within this is answered 400, and refused at once when sent again (default: "
        f"{GRAMMAR_COMPILE_TIMEOUT_S:g})",
    )
    grammar.add_argument(
        "--grammar-compile-threads",
        metavar="N",
        type=int_at_least(1),
        default=GRAMMAR_COMPILE_THREADS,
        help=f"threads compiling constraints (default: {GRAMMAR_COMPILE_THREADS})",
    )


def _seconds(text: str) -> float:
    """A positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


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
