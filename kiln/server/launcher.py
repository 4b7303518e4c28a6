"""Start-up and shutdown of `kiln serve`: load the engine, bind uvicorn, log `Ready: ...`, exit 0 on SIGINT/SIGTERM.

Shutdown order: stop accepting connections, let in-flight requests finish for up to `--shutdown-timeout`
seconds (then cancel them), abort whatever is left in the engine, let the engine loop return, exit 0. If the
engine loop dies instead, the server stops and exits 1.

The serve flags are checked before the model loads (a bad API-key source fails in a second, not after the load);
one that would do nothing beside the others or the engine's resolved config is refused (`inert_serve_flags`), as
kiln.engine.setup.inert_options refuses the engine's.

Threads: the engine loop runs on the main thread, where the model was loaded and compiled, and uvicorn's
event loop in a `kiln-http` thread (see kiln/engine/serving/async_engine.py for why: OpenMP is ~2x slower on a
second thread). Signals arrive on the main thread and are handed to uvicorn.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import ipaddress
import logging
import signal
import socket
import threading
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from types import FrameType

import uvicorn
from fastapi import FastAPI

from kiln.config import EngineConfig
from kiln.engine.core import EngineCore
from kiln.engine.serving.async_engine import AsyncEngine
from kiln.engine.setup.args import EngineArgs
from kiln.engine.setup.build import build_engine
from kiln.engine.setup.resolve import resolve_engine_config
from kiln.env import read_env
from kiln.errors import ConfigError
from kiln.log import setup_logging
from kiln.server.api import AppSettings, create_app
from kiln.server.connection_table import ConnectionTable
from kiln.server.connections import http_config
from kiln.server.grammar_limits import GrammarLimits
from kiln.server.limits import ServerLimits
from kiln.server.server_args import ServerArgs

logger = logging.getLogger("kiln")

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
API_KEY_ENV = "KILN_API_KEY"
_SERVE_DEFAULTS = {f.name: f.default for f in fields(ServerArgs)}  # a serve flag is given when it differs


class KilnServer(uvicorn.Server):
    """uvicorn, plus the `Ready:` line once the socket is bound, and signals that end in a clean exit 0."""

    def __init__(self, config: uvicorn.Config, model_name: str, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.model_name = model_name
        self.shutdown_timeout = shutdown_timeout

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            logger.info("Ready: %s (model %s)", self.url, self.model_name)

    @property
    def url(self) -> str:
        port = self.config.port
        if self.servers and self.servers[0].sockets:
            port = self.servers[0].sockets[0].getsockname()[1]  # the real port when --port 0
        host = self.config.host
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # NOTE: uvicorn re-raises a captured signal after its graceful shutdown, which turns SIGTERM into a kill by
        # signal (and SIGINT into a KeyboardInterrupt); kiln has already shut down cleanly by then, so exit 0.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self._on_signal) for sig in _SIGNALS}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            logger.info(
                "%s: shutting down; in-flight requests get up to %.0f s to finish (send it again to force)",
                signal.Signals(sig).name,
                self.shutdown_timeout,
            )
        self.handle_exit(sig, frame)


def run_server(args: argparse.Namespace) -> int:
    """Load the model, serve until SIGINT/SIGTERM, return the exit code."""
    setup_logging()
    _configure_uvicorn_logging(args.access_log)
    api_key = resolve_api_key(args, read_env().api_key)
    # NOTE: built exactly as `kiln generate` builds its engine, so every engine flag means the same in both.
    config = resolve_engine_config(EngineArgs.from_cli_args(args))
    check_server_args(args, api_key, config)
    if not _is_loopback(args.host) and api_key is None:
        logger.warning("Binding %s without an API key: anyone who can reach this port can use the model", args.host)
    logger.info("Loading model %s", args.model)
    core = build_engine(config)
    app = build_app(core, args, api_key)
    engine: AsyncEngine = app.state.engine
    # NOTE: what start-up made (torch, the model, compiled graphs: millions of objects) lives as long as the server,
    # so it leaves the collector's generations (as vLLM freezes its heap): a full collection walked it all, a 250 ms
    # pause of every stream, set off by whatever allocates (a third adapter loaded while a stream ran, here)
    gc.collect()
    gc.freeze()
    server = http_server(app, args)
    failure: list[SystemExit] = []

    def serve_http() -> None:
        try:
            server.run()
        except SystemExit as exc:  # uvicorn exits this way when it cannot bind or start the app
            failure.append(exc)
        finally:
            engine.request_stop()  # the app's shutdown already stopped it, unless the app never started

    http = threading.Thread(target=serve_http, name="kiln-http")
    has_loop_died = False
    with server.capture_signals():
        http.start()
        try:
            engine.run_loop()
        except Exception:
            has_loop_died = True  # run_loop logged the traceback
        finally:
            server.should_exit = True  # already set after a normal stop; ends uvicorn if the engine loop died
            http.join()
            core.close()  # the other ranks of a multi-device engine
    if has_loop_died:
        logger.error("Server stopped: its engine loop died (the cause is above)")
        return 1
    if failure:
        logger.error("Could not serve on %s:%d (see the error above); pick another --host/--port", args.host, args.port)
        code = failure[0].code
        return code if isinstance(code, int) and code else 1
    if not server.started:
        return 1
    logger.info("Server stopped")
    return 0


def build_app(core: EngineCore, args: argparse.Namespace, api_key: str | None) -> FastAPI:
    """The app `kiln serve` runs over `core`, set up by the serve flags. Its engine (`app.state.engine`) does not
    own a thread: the caller runs `engine.run_loop()`."""
    model_name = args.served_model_name or _default_model_name(core.checkpoint_path)
    aliases = tuple(n for n in (args.model, core.model_config.name) if n and n != model_name)
    engine = AsyncEngine(core, max_queue=args.max_queue, own_thread=False, max_buffered_outputs=args.max_stream_buffer)
    limits = ServerLimits.for_model(
        core.max_model_len,
        args.max_prompt_chars,
        max_body_bytes=args.max_body_bytes,
        body_timeout_s=args.body_timeout,
        max_seqs_per_request=args.max_seqs_per_request,
        max_stop_strings=args.max_stop_strings,
        max_stop_chars=args.max_stop_chars,
    )
    per_peer = args.max_connections_per_peer or max(1, args.max_connections // 2)
    app_connections = ConnectionTable(args.max_connections, per_peer)
    allowed = frozenset(h.strip() for h in (args.allowed_hosts or "").split(",") if h.strip())
    parse = args.completion_special_tokens == "parse"
    parser = args.tool_call_parser
    grammar_limits = GrammarLimits(
        max_bytes=args.max_grammar_bytes,
        max_choices=args.max_grammar_choices,
        max_depth=args.max_schema_depth,
        compile_timeout_s=args.grammar_compile_timeout,
    )
    settings = AppSettings(
        served_model_name=model_name,
        model_aliases=aliases,
        api_key=api_key,
        metrics_auth=args.metrics_auth,
        limits=limits,
        allowed_hosts=allowed,
        parse_special_tokens=parse,
        tool_call_parser=parser,
        grammar_limits=grammar_limits,
        grammar_compile_threads=args.grammar_compile_threads,
        reasoning_parser=args.reasoning_parser,
        runtime_lora_updating=args.allow_runtime_lora_updating,
    )
    return create_app(engine, settings, app_connections)


def http_server(app: FastAPI, args: argparse.Namespace) -> KilnServer:
    """The HTTP server `kiln serve` runs `app` in (nothing bound yet): address, timeouts, connection limits and the
    access log, as the serve flags set them."""
    uv_config = http_config(
        app,
        args.host,
        args.port,
        header_timeout=args.header_timeout,
        keep_alive_timeout=args.keep_alive_timeout,
        connections=app.state.connections,
        log_config=None,
        access_log=args.access_log,
        timeout_graceful_shutdown=args.shutdown_timeout,
        lifespan="on",
    )
    return KilnServer(uv_config, app.state.settings.served_model_name, args.shutdown_timeout)


def resolve_api_key(args: argparse.Namespace, env_api_key: str | None) -> str | None:
    """The API key from --api-key-file, --api-key or KILN_API_KEY (a flag wins over the variable); None: no key.

    ConfigError for both flags at once, a file that cannot be read, or a flag that gives an empty key.
    """
    if args.api_key is not None and args.api_key_file is not None:
        raise ConfigError("both --api-key and --api-key-file are given; pass one (--api-key-file keeps it out of ps)")
    if args.api_key_file is not None:
        path = Path(args.api_key_file).expanduser()
        try:
            key = path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ConfigError(
                f"--api-key-file {path}: cannot read the API key ({reason}); give a readable UTF-8 text file"
            ) from None
        source = f"--api-key-file {path}"
    elif args.api_key is not None:
        logger.warning("--api-key can be read by other users in ps; prefer --api-key-file or %s", API_KEY_ENV)
        key, source = args.api_key.strip(), "--api-key"
    else:
        return env_api_key
    if not key:
        raise ConfigError(f"{source} gives an empty API key; give a key, or leave the flag out to serve without one")
    return key


def check_server_args(args: argparse.Namespace, api_key: str | None, config: EngineConfig) -> None:
    """ConfigError for serve flags that contradict each other, or that would do nothing beside the others and the
    engine's resolved `config` (its recipe included), as kiln.engine.setup.inert_options refuses engine flags."""
    if args.metrics_auth and api_key is None:
        raise ConfigError(f"--metrics-auth needs an API key to check; give --api-key-file, --api-key or {API_KEY_ENV}")
    if lines := inert_serve_flags(args, api_key, config):
        raise ConfigError("; ".join(lines))
    capacity = args.max_num_seqs + args.max_queue
    if args.max_seqs_per_request > capacity:
        raise ConfigError(
            f"--max-seqs-per-request={args.max_seqs_per_request} is more than the server ever admits "
            f"(--max-num-seqs={args.max_num_seqs} + --max-queue={args.max_queue} = {capacity}), so such requests "
            "would be refused with 429 forever; lower it or raise --max-queue"
        )


def inert_serve_flags(args: argparse.Namespace, api_key: str | None, config: EngineConfig) -> list[str]:
    """Why each serve flag given (a value other than its default) does nothing in this setting: one line each."""
    given = {name for name, default in _SERVE_DEFAULTS.items() if getattr(args, name) != default}
    lines = []
    if "allowed_hosts" in given and api_key is not None:
        lines.append(
            "--allowed-hosts does nothing beside an API key: the key is checked instead of the Host header; drop it"
        )
    if "allow_runtime_lora_updating" in given and not config.lora.enabled:
        lines.append(
            "--allow-runtime-lora-updating does nothing without --enable-lora (or a recipe's lora section): drop it "
            "or enable LoRA"
        )
    if "max_stop_chars" in given and args.max_stop_strings == 0:
        lines.append("--max-stop-chars does nothing with --max-stop-strings 0 (every stop string is refused): drop one")
    if "keep_alive_timeout" in given and args.keep_alive_timeout >= args.header_timeout:
        lines.append(
            f"--keep-alive-timeout {args.keep_alive_timeout:g} does nothing at or above --header-timeout "
            f"{args.header_timeout:g}: an idle kept-alive connection meets the header deadline first (408, closed); "
            "lower it or raise --header-timeout"
        )
    return lines


def _default_model_name(checkpoint_path: str) -> str:
    """`SmolLM2-135M-Instruct.Q4_1` for a .gguf file, the directory name for an HF checkpoint."""
    path = Path(checkpoint_path)
    return path.name.removesuffix(".gguf") if path.is_file() else path.name


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _configure_uvicorn_logging(access_log: bool) -> None:
    """uvicorn's own messages in kiln's `[LEVEL] message` format: warnings and errors, plus access lines if asked."""
    formatter = logging.Formatter("[%(levelname)s] %(message)s")
    for name, level in (("uvicorn.error", logging.WARNING), ("uvicorn.access", logging.INFO)):
        log = logging.getLogger(name)
        if not log.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(formatter)
            log.addHandler(handler)
        log.setLevel(level)
        log.propagate = False
    logging.getLogger("uvicorn.access").disabled = not access_log
