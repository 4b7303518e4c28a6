"""Fairness of the scheduler under a long prompt: while other requests run or wait, one request prefills at most
`long_prefill_token_threshold` tokens a step, so every other stream gets a token each step (a 2,040-token prompt
once held every stream for its whole prefill, 11.5 s). Alone, a prompt prefills as much as the budget allows.
Pure bookkeeping: no model runs."""

from __future__ import annotations

from kiln.config import SchedulerConfig
from kiln.engine.request import Request
from kiln.engine.sampling.sampling_params import SamplingParams
from kiln.engine.scheduling.kv_cache import BlockPool
from kiln.engine.scheduling.scheduler import Scheduler


def request(rid: str, prompt_len: int) -> Request:
    return Request(rid, None, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=64, temperature=0), None)


def run_step(scheduler: Scheduler) -> dict[str, int]:
    out = scheduler.schedule()
    for s in out.scheduled:
        scheduler.advance(s.request, s.num_new_tokens)
        if s.request.num_computed_tokens == s.request.num_tokens:
            s.request.output_token_ids.append(5)
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled}


TOKENS_ONLY = dict(long_prefill_step_seconds=0.0)  # the token threshold alone (steps here are not timed)


def test_a_long_prompt_is_chunked_while_a_stream_decodes() -> None:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048, **TOKENS_ONLY)
    scheduler = Scheduler(config, BlockPool(512, 16))
    scheduler.add(request("stream", 8))
    assert run_step(scheduler) == {"stream": 8}
    scheduler.add(request("long", 2040))
    steps = [run_step(scheduler) for _ in range(4)]
    assert [s["long"] for s in steps] == [512, 512, 512, 504]  # four chunks of at most 512
    assert all(s["stream"] == 1 for s in steps)  # the stream got its token every step


def test_alone_a_prompt_takes_the_whole_budget_and_zero_turns_the_cap_off() -> None:
    alone = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048), BlockPool(512, 16))
    alone.add(request("long", 2040))
    assert run_step(alone) == {"long": 2040}
    off_config = SchedulerConfig(max_num_batched_tokens=2048, long_prefill_token_threshold=0, **TOKENS_ONLY)
    off = Scheduler(off_config, BlockPool(512, 16))
    off.add(request("stream", 8))
    run_step(off)
    off.add(request("long", 2040))
    assert run_step(off) == {"stream": 1, "long": 2040}  # its whole prompt in one step, as before the cap


def test_one_request_of_many_sequences_leaves_batch_slots_to_others() -> None:
    """An n=8 request under max_num_seqs=8 runs 4 sequences at a time (half); a request that arrives after it
    runs in the same step instead of waiting for all 8 to finish."""
    first = run_step(eight_siblings_then_one(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048)))
    assert sorted(first) == ["big-0", "big-1", "big-2", "big-3", "small"]
    wide = eight_siblings_then_one(SchedulerConfig(max_num_seqs=8, max_running_per_request=8))
    assert "small" not in run_step(wide)  # without the cap the siblings take every slot


def eight_siblings_then_one(config: SchedulerConfig) -> Scheduler:
    """A scheduler holding one client request of 8 sequences (n=8), then a 4-token request of its own."""
    scheduler = Scheduler(config, BlockPool(512, 16))
    for i in range(8):
        sibling = request(f"big-{i}", 16)
        sibling.group = "big"
        scheduler.add(sibling)
    scheduler.add(request("small", 4))
    return scheduler
