"""kiln's side of the benchmark: closed-loop runs of the engine at a fixed concurrency."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tqdm import tqdm

from kiln.bench.metrics import RunResult
from kiln.engine.request import RequestOutput
from kiln.engine.sampling.sampling_params import SamplingParams
from kiln.errors import KilnError

if TYPE_CHECKING:
    from kiln.engine.serving.llm import LLM


def run_kiln(llm: LLM, mode: str, prompts: list[list[int]], output_len: int, batch_size: int) -> RunResult:
    """Run `prompts` with at most `batch_size` in flight (a new one is added as soon as one finishes),
    after a prefill-only pass (one output token each) at the same concurrency."""
    prefill_s, _ = _closed_loop(llm, prompts, 1, batch_size, f"kiln {mode} bs={batch_size} prefill")
    prefix = llm.engine.scheduler.prefix
    queries, hits = (prefix.stats.queries, prefix.stats.hits) if prefix else (0, 0)
    spec = llm.engine.speculator
    drafts, accepted = (spec.stats.num_drafts, spec.stats.num_accepted_tokens) if spec else (0, 0)
    wall_s, outputs = _closed_loop(llm, prompts, output_len, batch_size, f"kiln {mode} bs={batch_size}")
    done = []
    for out in outputs:
        m = out.metrics
        assert m.first_token_time is not None and m.finished_time is not None
        done.append((m.arrival_time, m.first_token_time, m.finished_time, out.token_ids))
    result = RunResult.closed_loop("kiln", mode, batch_size, prompts, output_len, wall_s, prefill_s, done)
    if prefix is not None:
        result.prefix_hit_rate = (prefix.stats.hits - hits) / max(1, prefix.stats.queries - queries)
    if spec is not None:  # tokens a verification emitted in the run (1 + accepted drafts); 1.0: none verified
        result.acceptance_length = 1 + (spec.stats.num_accepted_tokens - accepted) / max(
            1, spec.stats.num_drafts - drafts
        )
    return result


def warm_up_kiln(llm: LLM, prompt: list[int]) -> None:
    """One short request so that first-call costs (allocation, compilation) stay out of the timings."""
    _closed_loop(llm, [prompt], 2, 1, None)


def _closed_loop(
    llm: LLM, prompts: list[list[int]], output_len: int, batch_size: int, desc: str | None
) -> tuple[float, list[RequestOutput]]:
    engine = llm.engine
    # NOTE: each pass starts from an empty prefix cache: a pass must not find the prompts of the one before it
    engine.reset_prefix_cache(quiet=True)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    tag = f"bench-{time.monotonic_ns()}"
    done: dict[str, RequestOutput] = {}
    num_added = 0
    bar = tqdm(total=len(prompts), desc=desc, unit="req", disable=desc is None)
    start = time.monotonic()
    while len(done) < len(prompts):
        while num_added < len(prompts) and num_added - len(done) < batch_size:
            engine.add_request(f"{tag}-{num_added}", prompts[num_added], params)
            num_added += 1
        for out in engine.step():
            if out.finished:
                _check_finished(out, output_len)
                done[out.request_id] = out
                bar.update(1)
    wall_s = time.monotonic() - start
    bar.close()
    return wall_s, [done[f"{tag}-{i}"] for i in range(len(prompts))]


def _check_finished(out: RequestOutput, output_len: int) -> None:
    if out.error or len(out.token_ids) != output_len:
        raise KilnError(
            f"bench request {out.request_id} finished with {len(out.token_ids)} of {output_len} tokens "
            f"(finish_reason={out.finish_reason!r}{', ' + out.error if out.error else ''})"
        )
