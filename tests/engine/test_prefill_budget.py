"""Prefill chunks budgeted by cost (issue 51): a chunk's attention grows with its context, so with 512-token chunks
an 8,000-token prompt's last chunks cost ~3.5x its first and every stream's gap grew with them (13 s on a shared
2-core machine). Now the chunk shrinks as its context grows, and to the measured step time's target. Pure
bookkeeping: no model runs."""

from __future__ import annotations

import itertools

import pytest

from kiln.config import SchedulerConfig
from kiln.engine.scheduling.kv_cache import BlockPool
from kiln.engine.scheduling.prefill_budget import (
    GROWTH,
    MIN_TIMED_COST,
    PROBE_TOKENS,
    PrefillBudget,
    attention_tokens_of,
)
from kiln.engine.scheduling.scheduler import Scheduler
from kiln.model.loader import open_checkpoint
from tests.engine.test_long_prefill import request, run_step

SMOLLM2_ATTENTION_TOKENS = 3072.0  # 3,538,944 multiply-adds of products a layer over 2 x 9 heads x 64


def test_the_default_models_attention_costs_a_token_at_3072_positions() -> None:
    assert attention_tokens_of(open_checkpoint("default").config) == SMOLLM2_ATTENTION_TOKENS


def long_prompt_beside_a_stream(config: SchedulerConfig) -> tuple[Scheduler, list[dict[str, int]]]:
    scheduler = Scheduler(config, BlockPool(1024, 16), attention_tokens=SMOLLM2_ATTENTION_TOKENS)
    scheduler.add(request("stream", 8))
    run_step(scheduler)
    scheduler.add(request("long", 8000))
    steps = []
    while scheduler.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in scheduler.running):
        steps.append(run_step(scheduler))
    return scheduler, steps


def test_a_chunk_shrinks_as_its_context_grows() -> None:
    untimed = SchedulerConfig(max_num_batched_tokens=2048, long_prefill_step_seconds=0.0)  # the cost alone
    scheduler, steps = long_prompt_beside_a_stream(untimed)
    chunks = [s["long"] for s in steps if "long" in s]
    assert sum(chunks) == 8000 and all(s.get("stream") == 1 for s in steps)  # the stream: a token every step
    assert chunks[0] == 512 and chunks[-2] < 160  # the last full chunk is under a third of the first
    assert all(a >= b for a, b in itertools.pairwise(chunks))
    budget, start = scheduler.prefill, 0
    for chunk in chunks:  # every chunk costs at most a 512-token chunk at context 0 (before: up to 3.5x)
        assert budget.cost(chunk, start) <= budget.cost(512, 0) + 1e-9
        start += chunk
    assert budget.num_shrunk >= len(chunks) - 2


def test_a_measured_step_time_over_the_target_shrinks_the_chunk() -> None:
    budget = PrefillBudget(max_tokens=512, attention_tokens=SMOLLM2_ATTENTION_TOKENS, step_seconds=0.5)
    assert budget.chunk(2000, 0) == PROBE_TOKENS  # nothing measured yet: a probe, whose step is timed
    assert budget.cost(PROBE_TOKENS, 0) >= MIN_TIMED_COST
    budget.observe(cost=512.0, seconds=1.0)  # a 512-token chunk took a second here
    chunk = budget.chunk(2000, 0)
    assert budget.cost(chunk, 0) <= 256 + 1 and chunk > 200  # half a second's worth
    budget.observe(cost=MIN_TIMED_COST / 2, seconds=10.0)  # a chunk too small to time: its overheads dominate
    assert budget.chunk(2000, 0) == chunk
    for _ in range(50):  # decode-only steps of 0.1 s: a step's fixed part, not counted per unit of cost
        budget.observe(cost=0.0, seconds=0.1)
    for _ in range(50):  # small chunks whose steps are mostly that fixed part do not shrink the next ones
        budget.observe(cost=100.0, seconds=0.1 + 100 / 512)
    assert budget.cost(budget.chunk(2000, 0), 0) == pytest.approx(0.4 * 512, rel=0.05)  # (0.5 - 0.1) s of chunk
    for _ in range(50):  # a machine where a step's fixed part alone takes 0.45 s: the target cannot be met
        budget.observe(cost=0.0, seconds=0.45)
    assert budget.cost(budget.chunk(2000, 0), 0) == pytest.approx(0.45 * 512, rel=0.05)  # a fixed part's worth
    untimed = PrefillBudget(max_tokens=512, attention_tokens=None, step_seconds=0.0)
    untimed.observe(cost=512.0, seconds=10.0)
    assert untimed.chunk(2000, 7000) == 512  # no attention cost, no target: the token threshold alone


@pytest.mark.parametrize("seconds", [0.0, 0.5])
def test_alone_a_prompt_still_takes_the_whole_budget(seconds: float) -> None:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048, long_prefill_step_seconds=seconds)
    alone = Scheduler(config, BlockPool(512, 16), attention_tokens=SMOLLM2_ATTENTION_TOKENS)
    alone.prefill.observe(cost=512.0, seconds=5.0)
    alone.add(request("long", 2040))
    assert run_step(alone) == {"long": 2040}


def test_a_first_chunk_beside_a_stream_is_a_probe_until_a_step_is_timed() -> None:
    """Untimed, the token threshold made a first chunk of 1.8 s on a 2-core AVX2 machine (the stream's gap): now
    the first is a probe, and the budget takes over once its step is timed. A pipeline's loop times no step: its
    budget is the cost alone, never a probe."""
    config = SchedulerConfig(max_num_batched_tokens=2048, long_prefill_step_seconds=0.5)
    scheduler, steps = long_prompt_beside_a_stream(config)
    assert [s["long"] for s in steps[:3]] == [PROBE_TOKENS] * 3  # nothing times these bookkeeping steps
    scheduler.prefill.observe(cost=scheduler.prefill.cost(PROBE_TOKENS, 0), seconds=0.1)  # 64 tokens in 0.1 s
    assert scheduler.prefill.chunk(2000, 0) > PROBE_TOKENS
    pipelined = Scheduler(config, BlockPool(1024, 16), attention_tokens=SMOLLM2_ATTENTION_TOKENS, steps_in_flight=2)
    assert pipelined.prefill.chunk(2000, 0) == 512


def test_after_the_probe_chunks_grow_by_doubling_so_one_lucky_sample_sizes_no_big_chunk() -> None:
    """A probe of 64 tokens took 0.3-0.5 s beside a stream on a 2-core AVX2 machine (target 0.2 s), and a probe
    timed fast by chance sized the next chunk from that one sample: now the probe is the smallest chunk and each
    chunk costs at most twice the costliest step timed so far."""
    budget = PrefillBudget(max_tokens=2048, attention_tokens=SMOLLM2_ATTENTION_TOKENS, step_seconds=0.2)
    budget.observe(cost=0.0, seconds=0.04)  # the stream's decode steps
    assert budget.chunk(8000, 0) == PROBE_TOKENS
    budget.observe(cost=budget.cost(PROBE_TOKENS, 0), seconds=0.041)  # lucky: 16 tokens in a millisecond
    costs = []
    start = PROBE_TOKENS
    for _ in range(8):  # each step then runs at 1 ms per unit of cost (0.16 s of chunk: ~155 tokens)
        chunk = budget.chunk(8000 - start, start)
        costs.append(budget.cost(chunk, start))
        budget.observe(cost=costs[-1], seconds=0.04 + costs[-1] / 1000)
        start += chunk
    assert costs[0] <= GROWTH * budget.cost(PROBE_TOKENS, 0) + 1e-9  # not the 0.16 s / 1 us a unit it "measured"
    assert all(b <= GROWTH * a + 1e-9 for a, b in itertools.pairwise(costs[:3]))
    assert 0.12 <= costs[-1] / 1000 <= 0.2  # settled near the target's chunk time


def test_a_steps_cost_is_its_chunks_alone() -> None:
    """The fixed part (decode-only steps, timed) holds the decode rows: counting them again per unit of cost
    would make chunks beside many streams too large."""
    config = SchedulerConfig(max_num_batched_tokens=2048, long_prefill_step_seconds=0.0)
    scheduler = Scheduler(config, BlockPool(1024, 16), attention_tokens=SMOLLM2_ATTENTION_TOKENS)
    for i in range(4):
        scheduler.add(request(f"stream{i}", 8))
    run_step(scheduler)
    decodes = scheduler.schedule()
    assert decodes.decode_rows == 4 and scheduler.step_cost(decodes) == 0.0
    for s in decodes.scheduled:
        scheduler.advance(s.request, s.num_new_tokens)
        s.request.output_token_ids.append(5)
    scheduler.add(request("long", 8000))
    mixed = scheduler.schedule()
    chunk = next(s for s in mixed.scheduled if s.request.request_id == "long")
    assert len(mixed.scheduled) == 5
    assert scheduler.step_cost(mixed) == scheduler.prefill.cost(chunk.num_new_tokens, 0)


def test_prompts_that_arrive_together_with_none_decoding_are_not_probed() -> None:
    """The measured step time (and its probe) keeps a decoding sequence's gaps short: with none decoding, prompts
    that arrive together take the token threshold's cost alone (a 16-token probe of each of 32 prompts made the
    first step a quarter of the token budget)."""
    config = SchedulerConfig(max_num_batched_tokens=2048, long_prefill_step_seconds=0.5)
    scheduler = Scheduler(config, BlockPool(1024, 16), attention_tokens=SMOLLM2_ATTENTION_TOKENS)
    scheduler.add(request("a", 20))
    scheduler.add(request("b", 7))
    scheduler.add(request("long", 2000))
    assert run_step(scheduler) == {"a": 20, "b": 7, "long": 512}  # the threshold alone, no probe
    scheduler.add(request("late", 100))
    assert run_step(scheduler)["late"] == PROBE_TOKENS  # a and b decode now: the step time bounds chunks
