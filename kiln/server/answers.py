"""How an answer meets its client: the streaming response that aborts its engine requests however it ends, a
wait that gives up when the client disconnects, and the HTTP error of an output that failed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kiln.engine.request import RequestOutput
from kiln.engine.serving.request_stream import SLOW_READER
from kiln.server.errors import APIError

logger = logging.getLogger("kiln")

T = TypeVar("T")


class EngineStreamingResponse(StreamingResponse):
    """SSE whose engine requests are aborted however the response ends, even if the client left before the
    first event (then the event generator never starts, so its own cleanup never runs)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def raise_if_failed(out: RequestOutput, request_id: str) -> None:
    if out.finish_reason == SLOW_READER:
        raise APIError(408, out.error or "the client read the stream too slowly", code="slow_reader")
    if out.finish_reason == "error":
        # NOTE: the engine logged the cause under its own request id; this line ties that to the HTTP request's.
        logger.warning("request %s: engine request %s failed: %s", request_id, out.request_id, out.error)
        what = out.error or "the engine failed this request"
        if out.error_param is not None:  # the request's own grammar failed it: the client's error
            raise APIError(400, f"{what} (request {request_id})", out.error_param, "grammar_failed")
        raise APIError(500, f"{what} (request {request_id})", code="engine_error")
    if out.finish_reason == "abort":
        why = out.error or "the server is shutting down"
        raise APIError(503, f"request {out.request_id} was aborted: {why}", code="aborted")


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work`; if the client disconnects first, cancel it (which aborts its engine requests) and return None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return task.result() if not task.cancelled() else None


async def _wait_for_disconnect(request: Request) -> None:
    # NOTE: the body is already read, so the next ASGI message is `http.disconnect` when the client goes away.
    while (await request.receive())["type"] != "http.disconnect":
        pass
