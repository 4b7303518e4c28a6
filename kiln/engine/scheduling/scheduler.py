"""Continuous batching with a token budget, chunked prefill and preemption by recompute.

Each step: running requests first (decodes and unfinished prefill chunks), then waiting requests while the token
budget, the sequence limit and free KV blocks allow. While more than one request is unfinished, one request prefills
a chunk of at most `long_prefill_token_threshold` tokens' cost a step, and, while a sequence decodes beside it, of
at most `long_prefill_step_seconds` once timed (the chunk shrinks as its context grows,
kiln.engine.scheduling.prefill_budget), and one client request (prompts x n) runs at most `running_per_request`
sequences, so the others keep getting tokens and batch slots. When blocks run out, the most recently admitted
running request is preempted: its blocks are freed and it rejoins the front of the waiting queue to be recomputed
from its prompt and the tokens it has already produced. Under the priority policy (vLLM's) both queues are kept in
`priority_order` instead: the waiting are admitted lowest priority value first and the running are preempted from
the other end. Under a recipe's step constraints a request joins a step only with as many tokens as keep the step
paddable to an allowed shape (kiln.engine.scheduling.step_shape). The scheduler never runs a model and never touches
tensors. With speculative decoding, the step's proposer (kiln.engine.speculation) runs first, over the sequences
`decoding()` names, and `schedule` receives its draft tokens as plain data: each one more decode row of its
sequence, as many as the budget, a window and the step shapes allow; `trim_rejected` frees the blocks only rejected
drafts held.

With prefix caching (`self.prefix`, kiln.engine.scheduling.prefix_sharing) a waiting request is admitted at its longest
cached prefix and prefills only the rest; it waits while a running request computes its next uncached block (so one
system prompt sent by many clients at once is computed once); `advance` registers each block a step fills, and a
sibling choice's copy of a partial block is the step's `block_copies`, run before its forward.

Blocks come from one pool per `BlockGroup`: every layer's, or, when sliding-window layers alternate with global ones,
the global layers' and the sliding layers' (kiln.engine.scheduling.kv_window). A request grows in every group at once
and is preempted when any of them runs out. In a group whose layers slide (`window` > 0), `advance` frees the blocks
behind the window after each step (their entries become the pool's null block), and no step gives a sequence more live
blocks than the pool holds, so a long generation, or a recompute after preemption, needs a bounded number of blocks.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter, deque
from collections.abc import Mapping

from kiln.config import SchedulerConfig
from kiln.engine.request import Request, RequestStatus
from kiln.engine.scheduling.block_group import BlockGroup, blocks_short, window_cap
from kiln.engine.scheduling.kv_cache import BlockPool
from kiln.engine.scheduling.kv_window import num_dead_blocks
from kiln.engine.scheduling.prefill_budget import PrefillBudget
from kiln.engine.scheduling.prefix_cache import PrefixKeys
from kiln.engine.scheduling.prefix_sharing import NOTHING_CACHED, CachedPrefix, PrefixSharing
from kiln.engine.scheduling.scheduler_output import ScheduledRequest, SchedulerOutput
from kiln.engine.scheduling.step_shape import StepShaper
from kiln.errors import KilnError


def priority_order(req: Request) -> tuple[int, float]:
    """The priority policy's order: lower priority values first, then earlier arrivals (vLLM's)."""
    return req.priority, req.metrics.arrival_time


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_pool: BlockPool,
        shaper: StepShaper | None = None,
        window: int = 0,
        window_pool: BlockPool | None = None,
        steps_in_flight: int = 1,
        prefix_keys: PrefixKeys | None = None,
        attention_tokens: float | None = None,
        max_loras: int = 0,
    ) -> None:
        """`window` > 0: the layers slide with this window, so blocks behind it are released: every layer's, or with
        `window_pool`, only the sliding layers' (their own pool; `block_pool` then holds the global layers').
        `steps_in_flight` > 1: rank 0 of a pipeline keeps that many steps launched (kiln.engine.loop.pipelined).
        `prefix_keys`: prefix caching on (kiln.engine.scheduling.prefix_sharing), for models without a sliding window.
        `attention_tokens`: the context at which a token's attention costs as much as its weight products, so a
        prefill chunk shrinks as its context grows (kiln.engine.scheduling.prefill_budget; None: chunks counted in
        tokens). `max_loras`: the most LoRA adapters the running requests may use at once (each step's slots)."""
        self.config = config
        self.max_loras = max_loras
        self.by_priority = config.policy == "priority"
        self.pool = block_pool
        self.shaper = shaper
        self.window = window
        self.groups = [BlockGroup(block_pool, 0 if window_pool else window, 0)]
        if window_pool is not None:
            self.groups.append(BlockGroup(window_pool, window, 1))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # a pipeline keeps `steps_in_flight` steps of disjoint sequences launched (kiln.engine.loop.pipelined): the
        # requests of a launched step are neither scheduled nor preempted until it completes, and each step takes
        # at most its share of the active requests
        self.steps_in_flight = steps_in_flight
        self.in_flight: set[str] = set()
        if prefix_keys is not None and window:
            raise KilnError("prefix caching needs every layer to keep its whole context (this model slides)")
        self.prefix = PrefixSharing(block_pool, prefix_keys, steps_in_flight == 1) if prefix_keys else None
        # NOTE: a pipeline's loop launches steps without timing them: its budget is in cost alone
        step_seconds = config.long_prefill_step_seconds if steps_in_flight == 1 else 0.0
        self.prefill = PrefillBudget(config.long_prefill_token_threshold, attention_tokens, step_seconds)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        if self.by_priority:
            bisect.insort(self.waiting, request, key=priority_order)
        else:
            self.waiting.append(request)

    def schedule(self, proposed: Mapping[str, list[int]] | None = None) -> SchedulerOutput:
        """The next step; `proposed`: the draft tokens the step's proposer offers decoding sequences, by request id
        (of those `decoding()` named), each kept as far as it fits."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        share = -(-(len(self.running) + len(self.waiting)) // self.steps_in_flight)
        streaming = any(r.output_token_ids for r in self.running)  # a sequence is decoding: its gaps count
        proposed = proposed or {}
        i = 0
        while i < len(self.running) and budget > 0 and len(scheduled) < share:
            req = self.running[i]
            if req.request_id in self.in_flight:
                i += 1
                continue
            if drafts := self._drafts(proposed.get(req.request_id, []), req, scheduled, budget):
                num_new = len(drafts) + 1  # the last token and its drafts, each a decode row (shaped by _drafts)
            else:
                num_new = self._fit(
                    scheduled,
                    window_cap(self.groups, req, self._chunk(req, req.num_computed_tokens, budget, streaming)),
                )
            if num_new == 0:  # no allowed step shape holds it next to the others: it runs in a later step
                i += 1
                continue
            if not self._grow(req, num_new, out):
                continue  # `req` itself was preempted; self.running shrank
            scheduled.append(ScheduledRequest(req, num_new, drafts))
            budget -= num_new
            i += 1
        running_by_group = Counter(r.group for r in self.running if r.group is not None)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and len(scheduled) < share:
            req = self._next_waiting(running_by_group)
            if req is None:
                break
            found = self.prefix.lookup(req, self.running) if self.prefix else NOTHING_CACHED
            start = max(req.num_computed_tokens, found.start)
            num_new = req.num_tokens - start
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = self._chunk(req, start, budget, streaming)
            fitted = self._fit(scheduled, window_cap(self.groups, req, num_new))
            if fitted == 0 or (fitted < num_new and not self.config.enable_chunked_prefill):
                break
            num_new = fitted
            if not self._can_admit(req, start + num_new, found):
                break
            if self.prefix is not None and (copy := self.prefix.admit(req, found)) is not None:
                out.block_copies.append(copy)
            for group in self.groups:
                group.grow(req, req.num_computed_tokens + num_new)
            self.waiting.remove(req)
            if req.group is not None:
                running_by_group[req.group] += 1
            req.status = RequestStatus.RUNNING
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.monotonic()
            if self.by_priority:  # the running stay in priority order: the back is preempted first
                bisect.insort(self.running, req, key=priority_order)
            else:
                self.running.append(req)
            scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new
        scheduled.sort(key=lambda s: s.is_chunk)  # stable: decodes (and verifications) first
        out.scheduled = scheduled
        return out

    def _next_waiting(self, running_by_group: Counter[str]) -> Request | None:
        """The first waiting request whose client request is under its cap of running sequences, whose LoRA adapter
        (if any) is running or has a free slot, and that need not wait for a block another request is computing
        (kiln.engine.scheduling.prefix_sharing)."""
        cap = self.config.running_per_request
        adapters = {r.lora_id for r in self.running} - {None}
        for r in self.waiting:
            if r.group is not None and running_by_group[r.group] >= cap:
                continue
            if r.lora_id is not None and r.lora_id not in adapters and len(adapters) >= self.max_loras:
                continue  # every adapter slot is taken by running requests: it waits for one to finish
            if self.prefix is None or not self.prefix.waits(r, self.running):
                return r
        return None

    def _chunk(self, req: Request, start: int, budget: int, streaming: bool) -> int:
        """The tokens `req` computes this step from `start` on, within `budget`: while others run or wait (with
        chunked prefill) a chunk of at most the prefill budget's cost (kiln.engine.scheduling.prefill_budget), so a long
        prompt no longer holds every other stream for its whole prefill, nor for one costly chunk; its measured
        step time bounds the chunk only while a sequence is `streaming` (none decodes: no gap to keep short)."""
        wanted = min(req.num_tokens - start, budget)
        if not self.config.enable_chunked_prefill or len(self.running) + len(self.waiting) < 2:
            return wanted
        return self.prefill.chunk(wanted, start, timed=streaming)

    def step_cost(self, sched: SchedulerOutput) -> float:
        """What `sched`'s prefill chunks cost in the prefill budget's units (call before the step advances its
        requests); 0 when it prefills nothing (only steps with a chunk are timed). Its decode rows are left out:
        the budget's fixed part, timed on steps without a chunk, holds them."""
        chunks = [s for s in sched.scheduled if s.is_chunk]
        return sum(self.prefill.cost(s.num_new_tokens, s.request.num_computed_tokens) for s in chunks)

    def _fit(self, scheduled: list[ScheduledRequest], wanted: int) -> int:
        """How many of `wanted` new tokens one more sequence may bring to the step under the recipe's shapes."""
        if self.shaper is None:
            return wanted
        before = sum(s.num_new_tokens for s in scheduled)
        return self.shaper.largest_fit(before, sum(s.num_rows for s in scheduled) + 1, wanted)

    def decoding(self) -> list[Request]:
        """The running sequences whose next step decodes one token (not in flight), which may bring draft tokens to
        verify; an embedding's last prompt token decodes nothing, so it verifies none."""
        return [
            r
            for r in self.running
            if r.num_tokens - r.num_computed_tokens == 1 and r.request_id not in self.in_flight and not r.params.embed
        ]

    def launched(self, sched: SchedulerOutput) -> None:
        """`sched` is in flight on a pipeline: its requests are neither scheduled nor preempted until it completes."""
        self.in_flight.update(s.request.request_id for s in sched.scheduled)

    def completed(self, sched: SchedulerOutput) -> None:
        """A step in flight completed: its requests may be scheduled again."""
        self.in_flight.difference_update(s.request.request_id for s in sched.scheduled)

    def _drafts(self, proposed: list[int], req: Request, scheduled: list[ScheduledRequest], budget: int) -> list[int]:
        """Of `req`'s proposed draft tokens, as many as the budget, a window and the step shapes allow."""
        drafts = proposed[: window_cap(self.groups, req, budget) - 1]
        tokens, rows, shaper = sum(s.num_new_tokens for s in scheduled), sum(s.num_rows for s in scheduled), self.shaper
        while drafts and shaper is not None and not shaper.fits(tokens + len(drafts) + 1, rows + len(drafts) + 1):
            drafts.pop()
        return drafts

    def trim_rejected(self, req: Request) -> None:
        """`req` verified its draft tokens and kept those its tokens now hold: the blocks only its rejected drafts
        held are freed."""
        if not req.is_finished:
            for g in self.groups:
                g.trim(req, req.num_tokens)

    def blocks_short(self, num_tokens: int) -> tuple[int, int] | None:
        """kiln.engine.scheduling.block_group.blocks_short over this scheduler's pools (admission's check)."""
        return blocks_short(self.groups, num_tokens, self.config.enable_chunked_prefill)

    def advance(self, req: Request, num_new: int) -> None:
        """Record `num_new` more computed tokens of `req` and, in its sliding groups, free the blocks no later query
        sees."""
        req.num_computed_tokens += num_new
        if self.prefix is not None:
            self.prefix.register(req)
        for g in self.groups:
            blocks = req.block_tables[g.index]
            dead = num_dead_blocks(req.num_computed_tokens, g.window, g.pool.block_size)
            null = g.pool.null_block
            first = dead
            while first > 0 and blocks[first - 1] != null:  # released entries form a prefix: walk back to it
                first -= 1
            if first < dead:
                g.pool.free(blocks[first:dead])
                blocks[first:dead] = [null] * (dead - first)

    def _can_grow(self, req: Request, num_tokens: int) -> bool:
        return all(g.pool.can_allocate(g.needed(req, num_tokens)) for g in self.groups)

    def _can_admit(self, req: Request, num_tokens: int, found: CachedPrefix) -> bool:
        if self.prefix is None or not found.blocks:
            return self._can_grow(req, num_tokens)
        return self.pool.can_allocate(self.prefix.blocks_needed(found, num_tokens))  # caching: one group only

    def _grow(self, req: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Give `req` blocks for `num_new` more tokens, preempting from the back; False if `req` was preempted."""
        total = req.num_computed_tokens + num_new
        while not self._can_grow(req, total):
            victim = next(r for r in reversed(self.running) if r.request_id not in self.in_flight)
            self._preempt(victim, out)
            if victim is req:
                return False
        for g in self.groups:
            g.grow(req, total)
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self._release(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        if self.by_priority:
            bisect.insort(self.waiting, req, key=priority_order)
        else:
            self.waiting.appendleft(req)
        out.preempted.append(req.request_id)

    def _release(self, req: Request) -> None:
        if self.prefix is not None:
            self.prefix.forget(req)
        for g in self.groups:
            g.release(req)

    def finish(self, req: Request, reason: str, stop_reason: str | int | None = None) -> None:
        """Free a request's blocks and drop it from whichever queue holds it."""
        if req.is_finished:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        req.metrics.finished_time = time.monotonic()
