"""`ServerArgs`: every serving option of `kiln serve` (and `python -m kiln.launch`) in one dataclass, which generates
their flags as `EngineArgs` generates the engine's (kiln.engine.setup.arg_types.add_flags): one field per flag, its
help, default and group beside it.

Engine options (model, KV cache, batching, --recipe, graph mode, --seed) come from `EngineArgs`; the launcher
(kiln.server.launcher) reads both from the parsed flags. Light (no torch): `kiln --help` builds this parser.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from kiln.engine.setup.arg_types import add_flags, int_at_least, option, seconds
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

AUTH = "authentication"
LIMITS = "request limits"
GRAMMAR = "structured outputs"
GROUP_DESCRIPTIONS = {
    AUTH: "With an API key, /v1/* answers 401 unless the request has 'Authorization: Bearer KEY'; the key is checked "
    "before the body is read. The key comes from --api-key-file, --api-key or the KILN_API_KEY environment "
    "variable (a flag wins over the variable).",
    LIMITS: "Bounds on what one client can make the server do; a request over one is refused with the limit's name "
    "and value before the work starts.",
    GRAMMAR: "Constraints (response_format, guided_*, tools) are checked against these limits before they are "
    "compiled, then compiled on their own threads, one at a time per client, so no request waits for another's "
    "grammar.",
}


@dataclass(frozen=True)
class ServerArgs:
    host: str = option("127.0.0.1", "address to bind (default: loopback only)")
    allowed_hosts: str | None = option(
        None,
        "comma-separated Host names answered without an API key, beyond IP addresses and localhost ('*': any); "
        "other names get a 400, so a web page cannot reach the server by DNS rebinding",
        metavar="NAMES",
    )
    port: int = option(8000, "port to bind (0: any free port, shown in the Ready line)")
    served_model_name: str | None = option(None, "model id clients see (default: checkpoint file name)")
    shutdown_timeout: float = option(
        30.0, "seconds in-flight requests get to finish after SIGINT/SIGTERM before they are aborted"
    )
    access_log: bool = option(False, "log one line per HTTP request")
    completion_special_tokens: str = option(
        "parse",
        "how /v1/completions tokenizes a text prompt: 'parse' turns special-token text such as <|im_start|> into "
        "control tokens, as vLLM does (a client may write a chat by hand); 'text' keeps it as characters, so a "
        "prompt built from untrusted text cannot forge turns (chat messages are always kept as text)",
        choices=("parse", "text"),
    )
    tool_call_parser: str | None = option(
        None,
        "how chat answers are read for tool calls (default: by the chat template's format; a template without "
        "tools gets kiln's fallback prompt and the hermes parser)",
        choices=sorted(TOOL_PARSERS),
    )
    reasoning_parser: str | None = option(
        None,
        "how chat answers are split into reasoning (message.reasoning_content, delta.reasoning_content) and the "
        "answer (content): qwen3 reads a <think>...</think> the model opens, deepseek_r1 one the template may have "
        "opened (everything before </think> is reasoning); none leaves answers whole (default: by the chat "
        "template: deepseek_r1 when its generation prompt opens <think>, qwen3 when it writes <think> elsewhere, "
        "none otherwise; the start-up log names it)",
        choices=[*sorted(REASONING_PARSERS), "none"],
    )
    allow_runtime_lora_updating: bool = option(
        False, "allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API key; needs --enable-lora)"
    )

    api_key: str | None = option(
        None,
        "the API key; other users can read it in the process list (ps), so prefer --api-key-file or KILN_API_KEY",
        AUTH,
        metavar="KEY",
    )
    api_key_file: str | None = option(None, "read the API key from this file (stripped)", AUTH, metavar="PATH")
    metrics_auth: bool = option(False, "/metrics requires the API key too (default: open, like /health)", AUTH)

    body_timeout: float = option(
        BODY_TIMEOUT_S,
        "time a request body may take to arrive; a stalled or trickled upload gets 408 and its connection is "
        f"closed (default: {BODY_TIMEOUT_S:g})",
        LIMITS,
        metavar="SECONDS",
        type=seconds,
    )
    header_timeout: float = option(
        HEADER_TIMEOUT_S,
        "time a request's line and headers may take to arrive, from the connection's opening or its previous "
        "response; a connection that sends nothing or trickles headers gets 408 and is closed (default: "
        f"{HEADER_TIMEOUT_S:g})",
        LIMITS,
        metavar="SECONDS",
        type=seconds,
    )
    keep_alive_timeout: float = option(
        KEEP_ALIVE_TIMEOUT_S,
        f"an idle kept-alive connection is closed after this (default: {KEEP_ALIVE_TIMEOUT_S:g})",
        LIMITS,
        metavar="SECONDS",
        type=seconds,
    )
    max_connections: int = option(
        MAX_CONNECTIONS,
        "open connections at once; a new connection beyond them first closes the one idle longest (awaiting a "
        f"request), and gets 503 only when every one has a request in flight (default: {MAX_CONNECTIONS}; keep it "
        "under the process's file-descriptor limit, ulimit -n)",
        LIMITS,
        metavar="N",
        type=int_at_least(1),
    )
    max_connections_per_peer: int | None = option(
        None,
        "open connections from one address at once, handled as --max-connections among its own (default: half of "
        "--max-connections)",
        LIMITS,
        metavar="N",
        type=int_at_least(1),
    )
    max_body_bytes: int = option(
        MAX_BODY_BYTES,
        f"largest request body, checked before it is parsed; larger ones get 413 (default: {MAX_BODY_BYTES}, "
        f"{MAX_BODY_BYTES // MIB} MiB)",
        LIMITS,
        metavar="BYTES",
        type=int_at_least(1),
    )
    max_prompt_chars: int | None = option(
        None,
        "most characters in one prompt (a chat's messages together), checked before tokenizing, which holds the "
        f"GIL for ~1 s per million characters (default: {PROMPT_CHARS_PER_TOKEN} x --max-model-len, more than any "
        "prompt that fits needs)",
        LIMITS,
        metavar="N",
        type=int_at_least(1),
    )
    max_seqs_per_request: int = option(
        MAX_SEQS_PER_REQUEST,
        f"most completions one request may ask for: prompts x n (default: {MAX_SEQS_PER_REQUEST})",
        LIMITS,
        metavar="N",
        type=int_at_least(1),
    )
    max_stop_strings: int = option(
        MAX_STOP_STRINGS,
        f"most stop strings in one request; each is matched after every token (default: {MAX_STOP_STRINGS})",
        LIMITS,
        metavar="N",
        type=int_at_least(0),
    )
    max_stop_chars: int = option(
        MAX_STOP_CHARS,
        f"longest stop string, in characters (default: {MAX_STOP_CHARS})",
        LIMITS,
        metavar="N",
        type=int_at_least(1),
    )
    max_queue: int = option(
        MAX_QUEUE,
        "completions (prompts x n) allowed to wait beyond --max-num-seqs; more are answered 429 with Retry-After "
        f"(default: {MAX_QUEUE})",
        LIMITS,
        metavar="N",
        type=int_at_least(0),
    )
    max_stream_buffer: int = option(
        MAX_STREAM_BUFFER,
        "outputs (one per token per choice) a streaming response may hold that its client has not read; a client "
        f"further behind is cut off and its requests aborted (default: {MAX_STREAM_BUFFER})",
        LIMITS,
        metavar="N",
        type=int_at_least(1),
    )

    max_grammar_bytes: int = option(
        MAX_GRAMMAR_BYTES,
        f"largest constraint (a schema as JSON, a regex, a grammar, a choice list) (default: {MAX_GRAMMAR_BYTES})",
        GRAMMAR,
        metavar="BYTES",
        type=int_at_least(1),
    )
    max_grammar_choices: int = option(
        MAX_GRAMMAR_CHOICES,
        "most strings of a choice list, and most enum values and anyOf/oneOf branches of a schema (default: "
        f"{MAX_GRAMMAR_CHOICES})",
        GRAMMAR,
        metavar="N",
        type=int_at_least(1),
    )
    max_schema_depth: int = option(
        MAX_SCHEMA_DEPTH,
        f"deepest nesting of a JSON schema's objects and lists (default: {MAX_SCHEMA_DEPTH})",
        GRAMMAR,
        metavar="N",
        type=int_at_least(1),
    )
    grammar_compile_timeout: float = option(
        GRAMMAR_COMPILE_TIMEOUT_S,
        "a constraint not compiled within this is answered 400, and refused at once when sent again (default: "
        f"{GRAMMAR_COMPILE_TIMEOUT_S:g})",
        GRAMMAR,
        metavar="SECONDS",
        type=seconds,
    )
    grammar_compile_threads: int = option(
        GRAMMAR_COMPILE_THREADS,
        f"threads compiling constraints (default: {GRAMMAR_COMPILE_THREADS})",
        GRAMMAR,
        metavar="N",
        type=int_at_least(1),
    )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add one flag per field (`--max-queue` for `max_queue`), grouped, with help and defaults."""
        add_flags(parser, ServerArgs, GROUP_DESCRIPTIONS)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        """The serving options the parsed flags give."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})
