"""The scheduler's side of steps in flight on a pipeline (kiln.engine.loop.pipelined): a step takes at most its share
of the active requests, never one whose step is in flight, and preemption never picks one in flight (its blocks
are being written). Pure bookkeeping: no model runs."""

from __future__ import annotations

from kiln.config import SchedulerConfig
from kiln.engine.request import Request
from kiln.engine.sampling.sampling_params import SamplingParams
from kiln.engine.scheduling.kv_cache import BlockPool
from kiln.engine.scheduling.scheduler import Scheduler


def requests(n: int, prompt_len: int) -> list[Request]:
    params = SamplingParams(max_tokens=8, temperature=0)
    return [Request(f"r{i}", None, list(range(1, prompt_len + 1)), params, None) for i in range(n)]


def ids(sched) -> list[str]:
    return [s.request.request_id for s in sched.scheduled]


def launch(scheduler: Scheduler, sched) -> None:
    scheduler.in_flight.update(ids(sched))


def complete(scheduler: Scheduler, sched) -> None:
    """The step's update, as the engine makes it: computed tokens advance, and each sequence gets its next token."""
    scheduler.in_flight.difference_update(ids(sched))
    for s in sched.scheduled:
        scheduler.advance(s.request, s.num_new_tokens)
        s.request.output_token_ids.append(5)


def test_two_steps_in_flight_split_the_requests() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), BlockPool(64, 4))
    scheduler.steps_in_flight = 2
    for req in requests(6, 3):
        scheduler.add(req)
    first = scheduler.schedule()
    launch(scheduler, first)
    second = scheduler.schedule()
    launch(scheduler, second)
    assert ids(first) == ["r0", "r1", "r2"] and ids(second) == ["r3", "r4", "r5"]
    assert scheduler.schedule().is_empty  # every request is in flight
    complete(scheduler, first)
    third = scheduler.schedule()  # the first step's requests, now past their prompts
    assert ids(third) == ["r0", "r1", "r2"] and all(s.num_new_tokens == 1 for s in third.scheduled)


def test_one_step_at_a_time_takes_every_request() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), BlockPool(64, 4))
    for req in requests(6, 3):
        scheduler.add(req)
    assert len(scheduler.schedule().scheduled) == 6


def test_preemption_spares_requests_in_flight() -> None:
    """4 blocks of 4 tokens: two 8-token prompts hold 2 each. The one in flight is never the victim, even though
    it was admitted last: the request that needs a block preempts itself instead."""
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), BlockPool(4, 4))
    scheduler.steps_in_flight = 2
    a, b = requests(2, 8)
    scheduler.add(a)
    scheduler.add(b)
    first = scheduler.schedule()  # a's prompt (its share is 1 of the 2 requests)
    launch(scheduler, first)
    second = scheduler.schedule()  # b's prompt
    launch(scheduler, second)
    assert ids(first) == ["r0"] and ids(second) == ["r1"] and scheduler.pool.num_free_blocks == 0
    complete(scheduler, first)  # a's decode needs a new block (position 8 starts block 2): none is free
    out = scheduler.schedule()
    assert out.preempted == ["r0"] and out.is_empty  # a preempted itself; b, in flight, kept its blocks
    assert b.block_ids and scheduler.running == [b]
