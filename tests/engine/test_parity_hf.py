"""The default model against HF transformers on the same dequantized GGUF, fp32."""

from __future__ import annotations

import warnings

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.bench.hf_runner import load_hf_model
from kiln.model.loader import default_model_path

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Here is a short story about a lighthouse keeper:",
    "List three prime numbers:",
]
NUM_TOKENS = 32
# Below this top-2 logit gap, HF's own argmax is a coin toss at fp32 rounding; a mismatch there is reported.
TIE_GAP = 1e-4


@pytest.fixture(scope="module")
def float32_kv_llm() -> LLM:
    """The dequantized reference (conftest's `llm`) with a float32 KV cache: HF's arithmetic, to 1e-3 in the logits
    (the default cache, bfloat16, moves them by ~0.1: tests/engine/test_kv_dtype_accuracy.py holds it to float32's,
    and the greedy tokens below run on it)."""
    return LLM("default", dtype="float32", seed=0, quantization="none", graph_mode="eager", kv_cache_dtype="float32")


@pytest.fixture(scope="module")
def hf_model():
    return load_hf_model(default_model_path(), "float32", "cpu")  # transformers' own dequantization of the file


def kiln_prompt_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    engine = llm.engine
    engine.add_request("parity", ids, SamplingParams(max_tokens=1, temperature=0))
    try:
        inputs = engine.runner.prepare(engine.scheduler.schedule())
        return engine.model.compute_logits(engine.runner.forward(inputs)[: len(ids)])
    finally:
        engine.abort("parity")


@pytest.mark.slow
def test_prompt_logits_match_hf(float32_kv_llm: LLM, hf_model) -> None:
    llm = float32_kv_llm
    for prompt in PROMPTS:
        ids = llm.tokenizer.encode(prompt)
        with torch.no_grad():
            expected = hf_model(torch.tensor([ids])).logits[0]
        got = kiln_prompt_logits(llm, ids)
        assert (got - expected).abs().max().item() <= 1e-3, prompt
    assert llm.engine.pool.num_used_blocks == 0


@pytest.mark.slow
def test_greedy_continuations_match_hf(llm: LLM, hf_model) -> None:
    """kiln's 32 greedy tokens must be HF's greedy tokens.

    Checked by teacher forcing: HF scores kiln's whole continuation in one forward, and every kiln token must
    be HF's argmax given the same prefix — by induction, exactly "HF's greedy continuation is identical".
    (HF `generate(min_new_tokens=...)` would not do: it masks EOS, which the greedy path may well pick.)
    """
    ids_list = [llm.tokenizer.encode(p) for p in PROMPTS]
    outs = llm.generate(ids_list, SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True))
    near_ties = []
    for ids, out in zip(ids_list, outs, strict=True):
        assert len(out.token_ids) == NUM_TOKENS
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1 : -1]
        hf_greedy = logits.argmax(-1).tolist()
        if out.token_ids == hf_greedy:
            continue
        first = next(i for i, (a, b) in enumerate(zip(out.token_ids, hf_greedy, strict=True)) if a != b)
        top2 = logits[first].topk(2).values
        gap = (top2[0] - top2[1]).item()
        # a divergence is only acceptable where HF itself sits on a near-tie; say so rather than hide it
        assert gap < TIE_GAP, f"diverged from HF at token {first} (HF top-2 gap {gap:.2e}) for {ids[:8]}..."
        near_ties.append((first, gap))
    if near_ties:
        warnings.warn(f"kiln and HF differ only at near-ties (token index, gap): {near_ties}", stacklevel=1)
    assert len(near_ties) < len(PROMPTS), "every prompt diverged: parity is not shown"


@pytest.mark.slow
def test_a_600_token_prompt_matches_hf_at_every_position(llm: LLM, hf_model) -> None:
    """Position-dependent error (a rotary table off by a little: theta x 1.001 moves the logits by ~1e-2 here)
    stays below 1e-3 in prompts of ten tokens; at 600 positions it shows. Today's max difference is ~7e-5."""
    text = " ".join(f"Line {i}: the kiln at station {i * 7 % 13} fired {i % 5 + 1} pots of clay." for i in range(40))
    ids = llm.tokenizer.encode(text)[:600]
    assert len(ids) == 600
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0]
    got = kiln_prompt_logits(llm, ids)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-3
    assert llm.engine.pool.num_used_blocks == 0
