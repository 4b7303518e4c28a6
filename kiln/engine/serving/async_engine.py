"""The engine loop for serving: one thread owns the EngineCore; asyncio callers get per-request queues.

The engine thread is a background thread by default; `kiln serve` runs the loop on the main thread instead
(`own_thread=False` + `run_loop()`), with HTTP in a thread.

NOTE: libgomp parallel regions launched from a second thread run about 2x slower once the main thread owns an
OpenMP pool (the engine is built there; a piecewise decode step 23 vs 40 ms): model work stays on that thread.

Rules:
- Only the engine thread touches the EngineCore. Callers submit commands (add, abort) as closures; the thread
  runs them between steps, so concurrent HTTP requests join the next continuous batch.
- Outputs of a step are handed to the event loop in one `call_soon_threadsafe` and put on the queue of the
  `RequestStream` that owns each request; model work never runs on the event loop.
- A stream that is closed before its requests finish (a client that went away) aborts them, which frees their
  KV blocks. A failing step fails only the requests it can be traced to (EngineCore isolates them) with
  `finish_reason="error"` and a message written for clients; the loop keeps going. If the loop itself dies (or a
  rank of a multi-device engine does: WorkerFailure), `is_healthy` turns False (/health answers 503).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import replace
from typing import TypeVar

from kiln.engine.core import EngineCore
from kiln.engine.request import RequestOutput
from kiln.engine.sampling.sampling_params import SamplingParams
from kiln.engine.serving.request_stream import (
    EngineStats,
    EngineStoppedError,
    RequestStream,
    Reservation,
    StreamTable,
    check_capacity,
    settle,
)
from kiln.errors import INTERNAL_ERROR, KilnError, WorkerFailure
from kiln.lora.request import LoRARequest

T = TypeVar("T")
logger = logging.getLogger("kiln")

Prompt = str | list[int]


class AsyncEngine:
    """Runs `EngineCore.step` in a background thread and serves requests to asyncio code.

    `max_queue`: how many requests may wait for a batch slot beyond `max_num_seqs` before `add_requests`
    raises QueueFullError (None: unbounded). `max_buffered_outputs`: how many outputs a stream may hold that
    its reader has not taken; a reader that falls further behind (a slow or stalled client) has its requests
    aborted, which frees their KV blocks, and its stream ends with an error output (None: unbounded).
    """

    def __init__(
        self,
        core: EngineCore,
        max_queue: int | None = None,
        *,
        own_thread: bool = True,
        max_buffered_outputs: int | None = None,
    ) -> None:
        self.core = core
        self.max_queue = max_queue
        self._num_reserved = 0  # room held by `reserve` for requests not added yet
        self._adding: set[asyncio.Future[None]] = set()  # add_requests calls waiting for the engine thread
        self.max_buffered_outputs = max_buffered_outputs
        self.own_thread = own_thread  # False: the caller runs `run_loop()` on a thread of its own
        self._streams = StreamTable(max_buffered_outputs, lambda rid: self._submit(lambda: self.core.abort(rid)))
        self._commands: deque[Callable[[], None]] = deque()
        self._wakeup, self._loop_done = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._is_accepting = self._is_stopping = False
        self._loop_error: BaseException | None = None  # what ended the engine loop, if it died
        self._stats = EngineStats().now(core)
        if core.workers is not None:  # a rank that dies wakes the loop, which then stops (WorkerFailure)
            core.workers.on_failure(self._wakeup.set)

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        """Accept requests (and start the engine thread when it owns one); call from the event loop that will
        consume the outputs."""
        if self._loop is not None:
            raise KilnError("AsyncEngine.start() called twice")
        self._loop = asyncio.get_running_loop()
        self._is_accepting = True
        if self.own_thread:
            self._thread = threading.Thread(target=self.run_loop, name="kiln-engine", daemon=True)
            self._thread.start()

    def run_loop(self) -> None:
        """The engine loop: steps while requests are unfinished, sleeps otherwise; returns once stopped."""
        try:
            self._run()
        except BaseException as exc:
            self._loop_error = exc
            self._is_accepting = False
            gone = isinstance(exc, WorkerFailure)  # NOTE: expected, and its message says it all: no traceback
            died = "the engine loop died%s: the server accepts no more requests (/health answers 503)"
            logger.error(died, f" ({exc})" if gone else "", exc_info=not gone)
            failure = (f"the engine stopped: worker {exc}", "abort") if gone else (INTERNAL_ERROR, "error")
            self._call_in_loop(self._fail_streams, *failure)
            raise
        finally:
            self._loop_done.set()

    def request_stop(self) -> None:
        """Make `run_loop` return without waiting for it (from any thread); `stop()` is the graceful path."""
        self._is_accepting = False
        self._is_stopping = True
        self._wakeup.set()

    async def stop(self) -> None:
        """Refuse new requests, abort the ones in flight (their streams end with `finish_reason="abort"`), and
        wait for the engine loop to return."""
        self._is_accepting = False
        if self._loop is None or self._loop_done.is_set():
            return
        if self._streams:
            logger.info("Aborting %d unfinished request(s)", len(self._streams))
        self._submit(self._abort_all)
        self.request_stop()
        await asyncio.to_thread(self._loop_done.wait)
        self._thread = None

    @property
    def is_healthy(self) -> bool:
        """The engine loop is running (or about to) and has not died: what /health reports."""
        return self._loop_error is None and self.is_accepting

    @property
    def is_accepting(self) -> bool:
        if self.own_thread:
            alive = self._thread is not None and self._thread.is_alive()
        else:  # commands queued before the caller's run_loop begins simply wait for it
            alive = not self._loop_done.is_set()
        return self._is_accepting and alive

    # -- requests ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def reserve(self, num_requests: int) -> Iterator[Reservation]:
        """Hold room for `num_requests` requests that do not exist yet (their prompts are being tokenized), so a
        flood is refused before any work is done on it. `add_requests(..., reservation)` turns the room into the
        requests in the same instant (a request is never counted twice); leaving the block gives back the rest.
        Raises QueueFullError when there is no room."""
        check_capacity(self.num_unfinished, num_requests, self.core.config.scheduler.max_num_seqs, self.max_queue)
        reservation = Reservation(num_requests)
        self._num_reserved += num_requests
        try:
            yield reservation
        finally:
            self._num_reserved -= reservation.held
            reservation.held = 0

    async def add_requests(
        self,
        requests: Sequence[tuple[str, Prompt, SamplingParams]],
        reservation: Reservation | None = None,
        priority: int = 0,
        lora: LoRARequest | None = None,
    ) -> RequestStream:
        """Add requests (id, prompt, params) all-or-nothing; return the stream of their outputs. With a
        `reservation` (see `reserve`) they take its room; `priority` is every one's (the scheduling policy's), and
        `lora` the adapter every one runs with (None: the base model).

        Raises RequestError for a request the engine rejects (nothing is added then), QueueFullError when the
        server is full, EngineStoppedError while shutting down.
        """
        if not self.is_accepting:
            raise EngineStoppedError("the server is shutting down and accepts no new requests")
        held = reservation.held if reservation is not None else 0
        check_capacity(
            self.num_unfinished - held, len(requests), self.core.config.scheduler.max_num_seqs, self.max_queue
        )
        stream = RequestStream(self.abort, [rid for rid, _, _ in requests])
        self._streams.open(stream)
        if reservation is not None:  # the room becomes the requests: counted once, from here on as streams
            self._num_reserved -= held
            reservation.held = 0
        assert self._loop is not None
        added: asyncio.Future[None] = self._loop.create_future()
        self._adding.add(added)
        self._submit(lambda: self._add_all(requests, added, priority, lora))
        try:
            await added
        except BaseException:
            stream.close()
            raise
        finally:
            self._adding.discard(added)
        return stream

    async def generate(self, request_id: str, prompt: Prompt, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as steps produce them; leaving the loop early aborts the request."""
        async with await self.add_requests([(request_id, prompt, params)]) as stream:
            async for out in stream:
                yield out

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks; no further outputs are delivered for it."""
        self._streams.forget(request_id)
        self._submit(lambda: self.core.abort(request_id))

    def stats(self) -> EngineStats:  # the snapshot of the last step
        return self._stats

    async def reset_prefix_cache(self) -> int:
        """Drop every evictable block of the prefix cache between two steps; returns how many were dropped."""
        assert self._loop is not None
        done: asyncio.Future[int] = self._loop.create_future()
        self._submit(lambda: self._call_in_loop(settle, done, None, self.core.reset_prefix_cache()))
        return await done

    async def in_engine(self, command: Callable[[], T]) -> T:
        """`command()` run on the engine thread between two steps (loading or unloading a LoRA adapter); its
        exception, if any, is raised here."""
        assert self._loop is not None
        done: asyncio.Future[T] = self._loop.create_future()

        def run() -> None:
            try:
                result = command()
            except Exception as exc:  # handed to the caller, which answers the client
                self._call_in_loop(settle, done, exc)
                return
            self._call_in_loop(settle, done, None, result)

        self._submit(run)
        return await done

    @property
    def num_unfinished(self) -> int:
        """Requests admitted and not finished (running, waiting, about to be added), and room reserved for more."""
        return len(self._streams) + self._num_reserved

    # -- the engine thread ------------------------------------------------------------------------
    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.append(command)
        self._wakeup.set()

    def _run(self) -> None:
        while not self._is_stopping:
            self._wakeup.clear()
            self.core.check_alive()
            self._run_commands()
            if self.core.has_unfinished:
                self._step()
            else:
                self._publish_stats()
                self._wakeup.wait()
        self._run_commands()
        self._publish_stats()

    def _run_commands(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            try:
                command()
            except Exception:  # NOTE: commands are bookkeeping (add, abort): a failure is a kiln bug, logged
                logger.exception("engine command failed")

    def _add_all(
        self,
        requests: Sequence[tuple[str, Prompt, SamplingParams]],
        added: asyncio.Future[None],
        priority: int,
        lora: LoRARequest | None,
    ) -> None:
        done: list[str] = []
        error: BaseException | None = None
        group = requests[0][0] if len(requests) > 1 else None  # siblings (prompts x n) share a running cap
        for rid, prompt, params in requests:
            try:
                self.core.add_request(rid, prompt, params, priority=priority, group=group, lora=lora)
            except Exception as exc:  # RequestError for bad input; anything else reaches the client as a 500
                error = exc
                break
            done.append(rid)
        for rid in done if error is not None else ():
            self.core.abort(rid)
        self._call_in_loop(settle, added, error)

    def _step(self) -> None:
        try:
            outputs = self.core.step()
        except WorkerFailure:
            raise  # another rank is gone: this engine cannot run any step again
        except Exception:  # NOTE: not traced to a request by EngineCore.step (the scheduler, or a lone request's step)
            ids = sorted(self.core.requests)
            logger.exception("engine step failed; failing the %d request(s) in the engine: %s", len(ids), ids)
            outputs = self._fail_all()
            self._stats = replace(self._stats, num_step_failures=self._stats.num_step_failures + 1)
        self._publish_stats()
        if outputs:
            self._call_in_loop(self._streams.deliver, outputs)

    def _fail_all(self) -> list[RequestOutput]:
        return [replace(out, finish_reason="error", error=INTERNAL_ERROR) for out in self._abort_in_core()]

    def _abort_in_core(self) -> list[RequestOutput]:
        return [out for rid in list(self.core.requests) if (out := self.core.abort(rid)) is not None]

    def _abort_all(self) -> None:
        if outputs := self._abort_in_core():
            self._call_in_loop(self._streams.deliver, outputs)

    def _publish_stats(self) -> None:
        self._stats = self._stats.now(self.core)

    def _call_in_loop(self, fn: Callable[..., None], *args: object) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            # NOTE: the event loop is closed only after the server stopped; nobody is left to receive outputs.
            logger.debug("event loop closed; dropped %s", getattr(fn, "__name__", fn))

    # -- on the event loop ------------------------------------------------------------------------
    def _fail_streams(self, message: str, reason: str) -> None:
        """The loop died: end every open stream with an error output (not even a client whose requests were still
        waiting to be added waits forever: its stream already holds the error)."""
        self._streams.fail_all(message, reason)
        for added in self._adding:
            settle(added, None)
