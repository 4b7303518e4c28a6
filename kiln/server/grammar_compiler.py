"""Structured outputs' grammars compiled off the tokenizer thread: a bounded pool, a deadline, one slot per client.

A grammar compiled on the tokenizer thread (where every request is tokenized) held admission for 32 s for one
100,000-choice list. Here a constraint is first checked against the size limits (kiln.server.grammar_limits), then
compiled on its own pool of `num_threads` threads (llguidance releases the GIL while it compiles), as vLLM compiles
while the request waits. Each client (its peer address) has one compile at a time, so one client's bombs queue
behind each other and cannot fill the pool. A compile that passes the deadline answers 400 naming the flag; it
keeps its thread until it ends (a Python thread cannot be stopped), and holds its client's slot till then, and its
constraint is refused at once from then on (kiln.engine.structured.grammar_cache remembers failures by key).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from kiln.engine.structured.constraint import StructuredOutput
from kiln.engine.structured.structured_output import Grammars
from kiln.errors import RequestError
from kiln.server.grammar_limits import GRAMMAR_COMPILE_THREADS, GrammarLimits
from kiln.server.limits import LimitExceeded

logger = logging.getLogger("kiln")


class GrammarCompiler:
    def __init__(
        self, grammars: Grammars | None, limits: GrammarLimits, num_threads: int = GRAMMAR_COMPILE_THREADS
    ) -> None:
        self.grammars, self.limits = grammars, limits
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="kiln-grammar")
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._num_holding: dict[str, int] = {}  # clients' compiles waiting or running, to drop idle slots
        self.num_timed_out = 0

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def compile(self, constraint: StructuredOutput, client: str, request_id: str) -> None:
        """Compile `constraint` into the engine's grammar cache; RequestError (a 400) when it is over a size
        limit, cannot be compiled or served, or takes longer than the deadline (counting its wait for the
        client's slot)."""
        grammars = self.grammars
        if grammars is None:
            raise RequestError("structured outputs need the model's tokenizer", None, constraint.param)
        self.limits.check(constraint)
        if grammars.cache.get(constraint.key) is not None:
            return
        if (why := grammars.cache.failure(constraint.key)) is not None:
            raise RequestError(f"{why} (request {request_id})", None, constraint.param)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.compile_timeout_s
        slot = self._slots.setdefault(client, asyncio.Semaphore(1))
        self._num_holding[client] = self._num_holding.get(client, 0) + 1
        try:
            await asyncio.wait_for(slot.acquire(), max(0.0, deadline - loop.time()))
        except BaseException as exc:  # past the deadline, or the client went away
            self._let_go(client)
            if isinstance(exc, TimeoutError):
                raise self._late(constraint, request_id, remember=False) from None
            raise
        work = loop.run_in_executor(self._pool, grammars.compile, constraint)
        work.add_done_callback(lambda _: (slot.release(), self._let_go(client)))
        try:
            await asyncio.wait_for(asyncio.shield(work), max(0.0, deadline - loop.time()))
        except TimeoutError:
            raise self._late(constraint, request_id, remember=True) from None
        except RequestError as exc:
            raise RequestError(f"{exc.args[0]} (request {request_id})", None, exc.param) from None

    def _late(self, constraint: StructuredOutput, request_id: str, remember: bool) -> LimitExceeded:
        """The 400 of a compile past the deadline; `remember`: it ran that long, so refuse it at once from now."""
        self.num_timed_out += 1
        limit = self.limits.compile_timeout_s
        message = (
            f"{constraint.param} took longer than {limit:g} s to compile (--grammar-compile-timeout={limit:g}); "
            "send a simpler constraint"
        )
        if remember and self.grammars is not None:
            self.grammars.remember_failure(constraint, message)
        logger.info(
            "request %s: grammar %s (%s, %d bytes) not compiled within %g s",
            request_id,
            constraint.key[:12],
            constraint.kind,
            len(constraint.spec),
            limit,
        )
        return LimitExceeded(f"{message} (request {request_id})", constraint.param, "grammar_compile_timeout")

    def _let_go(self, client: str) -> None:
        self._num_holding[client] -= 1
        if not self._num_holding[client]:
            del self._num_holding[client], self._slots[client]
