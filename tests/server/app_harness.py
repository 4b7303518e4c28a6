"""The app `kiln serve` builds from its flags (kiln.server.launcher.build_app), run in-process over a FakeCore.

The app's lifespan starts the engine, the engine loop runs on a thread (as `kiln serve` runs it on the main
thread), and an httpx client talks to the app through ASGI: no model, no socket, so tests take milliseconds.
httpx's ASGITransport re-raises whatever the app raises, so an exception that escapes the app fails the test.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI

from kiln.engine.serving.async_engine import AsyncEngine
from kiln.launch import build_parser
from kiln.server.launcher import build_app, check_server_args, resolve_api_key
from tests.server.fake_core import FakeCore


@dataclass
class Served:
    client: httpx.AsyncClient
    app: FastAPI
    core: FakeCore
    loop_errors: list[BaseException] = field(default_factory=list)  # what killed the engine loop, if anything

    @property
    def engine(self) -> AsyncEngine:
        return self.app.state.engine


def build_served_app(core: FakeCore, argv: Sequence[str] = (), environ: Mapping[str, str] | None = None) -> FastAPI:
    """What `kiln serve ARGV` builds over `core` (the API key read from `environ`, not the real environment)."""
    args = build_parser().parse_args(list(argv))
    api_key = resolve_api_key(args, (environ or {}).get("KILN_API_KEY", "").strip() or None)
    check_server_args(args, api_key, core.config)
    return build_app(core, args, api_key)  # type: ignore[arg-type]


def serve(
    core: FakeCore,
    body: Callable[[Served], Awaitable[Any]],
    argv: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> Any:
    """Run `body(served)` against the app of `kiln serve ARGV` over `core`; return what it returns."""
    app = build_served_app(core, argv, environ)

    async def main() -> Any:
        engine: AsyncEngine = app.state.engine
        served_loop_errors: list[BaseException] = []

        def run_loop() -> None:
            try:
                engine.run_loop()
            except Exception as exc:  # the engine logged it; the health test looks at it
                served_loop_errors.append(exc)

        loop_thread = threading.Thread(target=run_loop, name="fake-engine-loop")
        async with app.router.lifespan_context(app):
            loop_thread.start()
            try:
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=30) as client:
                    result = await body(Served(client, app, core, served_loop_errors))
            finally:
                core.gate.set()
        loop_thread.join(10)
        return result

    return asyncio.run(main())


async def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    """The `error` object of an OpenAI-shaped error response with this status (asserting the shape)."""
    assert response.status_code == status, response.text
    assert "Traceback" not in response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def serve_engine(core: Any, body: Callable[[httpx.AsyncClient], Awaitable[Any]], argv: Sequence[str] = ()) -> Any:
    """Run `body(client)` against the app of `kiln serve ARGV` over a real EngineCore `core`, its loop on a thread."""
    app = build_served_app(core, argv)  # type: ignore[arg-type]

    async def main() -> Any:
        thread = threading.Thread(target=app.state.engine.run_loop, name="engine-loop")
        async with app.router.lifespan_context(app):
            thread.start()
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=60) as client:
                result = await body(client)
        thread.join(10)
        return result

    return asyncio.run(main())
