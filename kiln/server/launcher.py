"""Start-up and shutdown of `kiln serve`: load the engine, bind uvicorn, log `Ready: ...`, exit 0 on SIGINT/SIGTERM.

Shutdown order: stop accepting connections, let in-flight requests finish for up to `--shutdown-timeout`
seconds (then cancel them), abort whatever is left in the engine, let the engine loop return, exit 0.

Threads: the engine loop runs on the main thread, where the model was loaded and compiled, and uvicorn's
event loop in a `kiln-http` thread (see kiln/engine/async_engine.py for why: OpenMP is ~2x slower on a
second thread). Signals arrive on the main thread and are handed to uvicorn.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import uvicorn

from kiln.engine.args import EngineArgs
from kiln.engine.async_engine import AsyncEngine
from kiln.engine.build import build_engine
from kiln.log import setup_logging
from kiln.server.api import AppSettings, create_app

logger = logging.getLogger("kiln")

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


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
    if not _is_loopback(args.host) and args.api_key is None:
        logger.warning("Binding %s without --api-key: anyone who can reach this port can use the model", args.host)
    logger.info("Loading model %s", args.model)
    # NOTE: built exactly as `kiln generate` builds its engine, so every engine flag means the same in both.
    core = build_engine(EngineArgs.from_cli_args(args).create_engine_config())
    model_name = args.served_model_name or _default_model_name(core.checkpoint_path)
    aliases = tuple(n for n in (args.model, core.model_config.name) if n and n != model_name)
    engine = AsyncEngine(core, max_queue=args.max_queue, own_thread=False)
    app = create_app(engine, AppSettings(model_name, aliases, args.api_key))
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_config=None,
        access_log=args.access_log,
        timeout_graceful_shutdown=args.shutdown_timeout,
        lifespan="on",
    )
    server = KilnServer(uv_config, model_name, args.shutdown_timeout)
    failure: list[SystemExit] = []

    def serve_http() -> None:
        try:
            server.run()
        except SystemExit as exc:  # uvicorn exits this way when it cannot bind or start the app
            failure.append(exc)
        finally:
            engine.request_stop()  # the app's shutdown already stopped it, unless the app never started

    http = threading.Thread(target=serve_http, name="kiln-http")
    with server.capture_signals():
        http.start()
        try:
            engine.run_loop()
        finally:
            server.should_exit = True  # already set after a normal stop; ends uvicorn if the engine loop died
            http.join()
    if failure:
        logger.error("Could not serve on %s:%d (see the error above); pick another --host/--port", args.host, args.port)
        code = failure[0].code
        return code if isinstance(code, int) and code else 1
    if not server.started:
        return 1
    logger.info("Server stopped")
    return 0


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
