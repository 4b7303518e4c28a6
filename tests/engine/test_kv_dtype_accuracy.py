"""End to end on the default model (Q4_1 GGUF, packed): each KV cache dtype against a float32 KV cache, everything
else equal, over 1,200 tokens of fixed text (the source of Python's difflib, as tests/quant/test_int8_accuracy.py):
mean KL divergence of the next-token distributions and top-1 agreement. bfloat16 (half float32's bytes; `auto`,
kiln.config.AUTO_KV_CACHE_DTYPE, stays float32: see its note) passes the bar (mean KL <= 1e-3); the others are
reported. Greedy tokens with each dtype equal the float32 cache's on the parity prompts except at near-ties: where
float32's top-2 gap is within what that cache's rounding moves a top-2 gap on the text (its 99th percentile).

The engines are the default's (packed weights, int8x2 activations, eager steps); the kernel plan is timed once per
process and machine and shared by every engine here (kiln.kernels.choices), so the only difference between two
engines is their KV cache. Prefill attends over the K/V as stored (kiln.model.attention), so the prompt's logits
measure the cache's rounding as decode would meet it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.model.kv_format import STORAGE, kv_dtype_name
from tests.engine.test_parity_hf import PROMPTS, kiln_prompt_logits
from tests.quant.test_int8_accuracy import NEAR_TIE, agreement, segments

MAX_KL = 1e-3  # the bar of the default, as for int8 activations
# the coarser formats' report: mean KL within this, or the cache is broken rather than rounded
REPORTED_KL = 2e-2
MAX_NEAR_TIE = 1.0  # nats of top-2 gap; measured (Xeon, AMX): bfloat16 0.09, float16 0.08, int8 0.26, fp8_e4m3 0.73
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def engine(kv_cache_dtype: str) -> LLM:
    return LLM("default", seed=0, graph_mode="eager", kv_cache_dtype=kv_cache_dtype, num_kv_blocks=96)


def packed_winners(llm: LLM) -> dict[str, object]:
    """The packed kernels each layout runs (the plan's choices, less where they were read from)."""
    choices = llm.engine.runner.executor.plan.choices["packed_kernels"]
    return {layout: {k: v for k, v in record.items() if k != "source"} for layout, record in choices.items()}


def log_probs(llm: LLM) -> torch.Tensor:
    with torch.inference_mode():
        return torch.cat([kiln_prompt_logits(llm, ids).double().log_softmax(-1) for ids in segments(llm)])


@pytest.fixture(scope="module")
def reference() -> Iterator[tuple[LLM, torch.Tensor, list[list[int]]]]:
    """The float32-KV engine, its log-probs over the text and its greedy tokens on the parity prompts."""
    llm = engine("float32")
    ids_list = [llm.tokenizer.encode(p) for p in PROMPTS]
    yield llm, log_probs(llm), [out.token_ids for out in llm.generate(ids_list, GREEDY)]


def gap_movement(reference: torch.Tensor, other: torch.Tensor) -> float:
    """How far a cache's rounding moves float32's top-2 log-prob gap over the scored text: the 99th percentile over
    positions. A greedy token may differ where float32's own gap is within it (a near-tie for this cache)."""
    top2 = reference.topk(2, dim=-1).indices
    gap = reference.gather(-1, top2)
    moved = other.gather(-1, top2)
    return torch.quantile(((gap[:, 0] - gap[:, 1]) - (moved[:, 0] - moved[:, 1])).abs(), 0.99).item()


def first_divergence(
    base: LLM, got: list[list[int]], expected: list[list[int]], near_tie: float
) -> tuple[int, int, float] | None:
    """(prompt, token, float32 top-2 logit gap there) of the first greedy token that differs from the float32
    cache's and is no near-tie (a gap of `near_tie` or more); None where every difference is at a near-tie."""
    prompts = [base.tokenizer.encode(p) for p in PROMPTS]
    for p, (ids, mine, theirs) in enumerate(zip(prompts, got, expected, strict=True)):
        if mine == theirs:
            continue
        first = next(i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b)
        with torch.inference_mode():
            top = kiln_prompt_logits(base, ids + theirs[:first])[-1].topk(2).values
        if (gap := (top[0] - top[1]).item()) >= near_tie:
            return p, first, gap
    return None


@pytest.mark.parametrize("name", ["bfloat16", "float16", "int8", "fp8_e4m3"])
def test_kv_dtype_against_a_float32_cache(
    reference: tuple[LLM, torch.Tensor, list[list[int]]], name: str, kiln_log: pytest.LogCaptureFixture
) -> None:
    base, expected_log_probs, expected = reference
    llm = engine(name)
    assert packed_winners(llm) == packed_winners(base)  # the same products: only the KV cache differs
    stored = {cache.dtype for cache in llm.engine.runner.kv_caches}
    assert stored == {STORAGE[name]}
    stored_name = kv_dtype_name(stored.pop())
    started = f"{stored_name})"
    assert any(r.getMessage().startswith("KV cache: ") and started in r.getMessage() for r in kiln_log.records)
    assert llm.engine.scheduler.prefix.keys.namespace.endswith(
        f"|{stored_name}"
    )  # kiln.engine.scheduling.prefix_sharing
    got_log_probs = log_probs(llm)
    kl, top1 = agreement(expected_log_probs, got_log_probs)
    near_tie = max(NEAR_TIE, gap_movement(expected_log_probs, got_log_probs))
    print(f"KV cache {name} ({stored_name}): mean KL {kl:.2e}, top-1 {top1:.2%}, near-tie {near_tie:.2e}")
    assert 0 < kl <= (MAX_KL if name == "bfloat16" else REPORTED_KL)  # > 0: the cache did round
    assert near_tie < MAX_NEAR_TIE  # a cache that moves the top-2 gap more is broken, not rounded
    ids_list = [llm.tokenizer.encode(p) for p in PROMPTS]
    outputs = [out.token_ids for out in llm.generate(ids_list, GREEDY)]
    diverged = first_divergence(base, outputs, expected, near_tie)
    assert diverged is None, f"KV cache {name} diverged from float32: (prompt, token, top-2 gap) {diverged}"
