"""What the async engine hands to asyncio callers: `RequestStream` (the outputs of one or more requests, in
order), the admission errors, and the stats snapshot the engine thread publishes after every step."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kiln.engine.request import RequestOutput
from kiln.errors import KilnError

logger = logging.getLogger("kiln")

# the finish reason of a request whose reader fell `max_buffered_outputs` behind: the client's doing, not the server's
SLOW_READER = "slow_reader"


class QueueFullError(KilnError):
    """More requests than the server admits (running + `max_queue` waiting); the client should retry later."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def check_capacity(num_unfinished: int, num_new: int, max_num_seqs: int, max_queue: int | None) -> None:
    """QueueFullError when `num_new` more requests would pass `max_num_seqs` running + `max_queue` waiting."""
    if max_queue is None:
        return
    capacity = max_num_seqs + max_queue
    if num_unfinished + num_new > capacity:
        raise QueueFullError(
            f"the server is full: {num_unfinished} requests in flight, room for {capacity} "
            f"(max_num_seqs={max_num_seqs} + max_queue={max_queue}); retry later",
            retry_after_s=1,
        )


class EngineStoppedError(KilnError):
    """The engine is shutting down or its loop has stopped; no new requests are accepted."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot the engine thread publishes after every step (read from any thread)."""

    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks_used: int = 0
    num_kv_blocks: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    num_step_failures: int = 0
    prefix_caching: bool = False
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of them, found cached
    speculative: dict[str, float | int] | None = None  # speculative decoding's counts (SpecStats.as_dict); None: off

    def now(self, core: Any) -> EngineStats:
        """These stats brought up to date from `core` (an EngineCore, read on its engine thread)."""
        sched, pool = core.scheduler, core.pool
        return replace(
            self,
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_kv_blocks_used=pool.num_used_blocks,
            num_kv_blocks=pool.num_blocks,
            num_preemptions=sched.num_preemptions,
            num_steps=core.num_steps,
            prefix_caching=sched.prefix is not None,
            prefix_cache_queries=sched.prefix.stats.queries if sched.prefix else 0,
            prefix_cache_hits=sched.prefix.stats.hits if sched.prefix else 0,
            speculative=core.speculator.stats.as_dict() if core.speculator else None,
        )

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class RequestStream:
    """Outputs of one or more engine requests (e.g. the `n` choices of one HTTP request), in the order produced.

    Iterate it for RequestOutputs; iteration ends when every request has finished. `close()` (also run by
    `async with`) aborts the requests that have not finished.
    """

    def __init__(self, abort: Callable[[str], None], request_ids: Sequence[str]) -> None:
        self.abort = abort  # the engine's: stops a request and frees its KV blocks
        self.request_ids = list(request_ids)
        self.unfinished = set(request_ids)
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self.unfinished:
            raise StopAsyncIteration
        out = await self.queue.get()
        if out.finished:
            self.unfinished.discard(out.request_id)
        return out

    def fail(self, request_id: str, message: str, reason: str = "error") -> None:
        """End one of the stream's requests with an error output (its engine request is dealt with elsewhere);
        `reason` "abort": the engine, not the request, could not go on (the server answers 503); SLOW_READER: the
        reader fell too far behind (a client error)."""
        self.queue.put_nowait(
            RequestOutput(request_id, None, [], "", [], finished=True, finish_reason=reason, error=message)
        )

    def close(self) -> None:
        for request_id in sorted(self.unfinished):
            self.abort(request_id)
        self.unfinished.clear()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


def settle(future: asyncio.Future[Any], error: BaseException | None, result: object = None) -> None:
    """Resolve a future of an engine-thread command from the event loop: done with `result`, or failed with
    `error`."""
    if future.done():  # the caller was cancelled while waiting (add_requests has aborted its requests)
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


@dataclass
class Reservation:
    """Room for `held` requests in the engine's queue (AsyncEngine.reserve)."""

    held: int


class StreamTable:
    """The open streams by request id, and the delivery of each step's outputs to them (on the event loop).

    `max_buffered_outputs`: outputs a stream may hold that its reader has not taken; a reader further behind has
    all of its stream's requests aborted (`abort`, which frees their KV blocks in the engine) and its stream ended
    with a `slow_reader` output (None: unbounded)."""

    def __init__(self, max_buffered_outputs: int | None, abort: Callable[[str], None]) -> None:
        self.max_buffered_outputs = max_buffered_outputs
        self.abort = abort
        self.by_id: dict[str, RequestStream] = {}

    def __len__(self) -> int:
        return len(self.by_id)

    def open(self, stream: RequestStream) -> None:
        for rid in stream.request_ids:
            self.by_id[rid] = stream

    def forget(self, request_id: str) -> RequestStream | None:
        """Deliver nothing more for this request (its caller aborted it)."""
        return self.by_id.pop(request_id, None)

    def deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self.by_id.get(out.request_id)
            if stream is None:
                continue  # aborted by its caller; the engine produced this output before the abort ran
            limit = self.max_buffered_outputs
            if limit is not None and not out.finished and stream.queue.qsize() >= limit:
                out = self._cut_off(stream, out, limit)
            if out.finished:
                self.by_id.pop(out.request_id, None)
            stream.queue.put_nowait(out)

    def fail_all(self, message: str, reason: str) -> None:
        """End every open stream with an error output (the engine loop died), so no client waits forever."""
        for rid, stream in list(self.by_id.items()):
            stream.fail(rid, message, reason)
        self.by_id.clear()

    def _cut_off(self, stream: RequestStream, out: RequestOutput, limit: int) -> RequestOutput:
        """A reader `limit` outputs behind: abort all of its stream's requests (freeing their KV blocks)."""
        logger.warning("request %s: its reader is %d outputs behind; aborting it", out.request_id, limit)
        message = f"the client read the stream too slowly: {limit} outputs waited (--max-stream-buffer); stopped"
        for rid in list(stream.unfinished):
            if self.by_id.pop(rid, None) is not None:
                self.abort(rid)
                if rid != out.request_id:
                    stream.fail(rid, message, SLOW_READER)
        return replace(out, finished=True, finish_reason=SLOW_READER, error=message, delta="", num_new_tokens=0)
