"""The sampler's filters on one row (every in-range value is served), and logit_bias."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM
from kiln.engine.sampling.sampler import Sampler, SamplingRow, filter_batch, row_max
from kiln.engine.sampling.sampling_params import SamplingParams
from kiln.errors import RequestError


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """`filter_batch` on one row."""
    return filter_batch(logits.unsqueeze(0), [params])[0]


def test_a_top_p_that_rounds_to_zero_keeps_the_most_likely_token() -> None:
    logits = torch.tensor([0.5, 3.0, -1.0, 2.9])
    for top_p in (1e-46, 5e-324, 1e-3):  # in (0, 1], but 0 in float32 for the first two
        kept = filter_logits(logits, SamplingParams(temperature=1.0, top_p=top_p)).isfinite()
        assert kept.tolist() == [False, True, False, False], top_p
    probs = filter_logits(logits, SamplingParams(temperature=1.0, top_p=1e-46)).softmax(-1)
    assert torch.isfinite(probs).all() and probs[1] == 1.0


def test_top_p_keeps_the_smallest_set_reaching_its_mass() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.75)).isfinite()
    assert kept.tolist() == [True, True, False, False]


def test_top_p_drops_the_token_whose_preceding_mass_reaches_it_exactly() -> None:
    """Four equally likely tokens (a quarter each, exact in float32) and top_p 0.5: two reach it, and the third,
    with exactly 0.5 before it, is dropped (the mass before it already reaches top_p), for the sort of a
    nucleus within the candidates and of the whole vocabulary alike."""
    for vocab in (4, 4096):
        logits = torch.full((vocab,), -1e9)
        logits[:4] = 2.0
        kept = filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.5)).isfinite()
        assert int(kept.sum()) == 2 and bool(kept[:4].any()), vocab


def test_logit_bias_is_added_to_its_rows_only() -> None:
    logits = torch.zeros(2, 10)
    logits[:, 4] = 5.0
    biased = SamplingParams(temperature=0, logit_bias={7: 100.0, 4: -100.0})
    rows = [SamplingRow(biased, [1], [], None, []), SamplingRow(SamplingParams(temperature=0), [1], [], None, [])]
    out = Sampler()(logits.clone(), rows)
    assert out.token_ids == [7, 4]
    assert out.logprobs == [None, None]
    with pytest.raises(RequestError) as too_big:
        SamplingParams(logit_bias={3: 101.0})
    assert too_big.value.param == "logit_bias"


def test_logit_bias_through_the_llm_api(llm: LLM) -> None:
    token = llm.engine.tokenizer.encode(" banana", add_special_tokens=False)[0]
    out = llm.generate("My favourite fruit is", SamplingParams(max_tokens=3, temperature=0, logit_bias={token: 100}))
    assert out[0].token_ids == [token] * 3
    (outside,) = llm.generate("x", SamplingParams(logit_bias={10**6: 1.0}))  # refused alone, named
    assert outside.finish_reason == "error" and "logit_bias token id 1000000 is outside" in (outside.error or "")


@pytest.mark.parametrize("width", [49152, 49152 + 77, 300, 100])
def test_row_max_is_torchs_max_with_the_first_index(width: int) -> None:
    """row_max (chunked amax) gives torch.max(dim=-1)'s values and first indices: ties inside a chunk, across chunks
    and with the columns past the last whole chunk, rows masked to -inf, and the value NaN where a row holds one."""
    generator = torch.Generator().manual_seed(width)
    logits = torch.randn(12, width, generator=generator).round(decimals=1)  # many equal values
    logits[1, [3, width - 1]] = 50.0  # the first column wins a tie with the last (in the tail where there is one)
    logits[2, [width - 1, width - 2]] = 60.0
    logits[3] = float("-inf")
    logits[4, width // 2] = float("nan")
    logits[5, width - 1] = float("nan")
    logits[6, :] = 7.0  # every column ties
    logits[7, [0, min(130, width - 1)]] = 9.0  # a tie across chunks
    best, tokens = row_max(logits)
    expected_best, expected_tokens = logits.max(dim=-1)
    assert torch.equal(best.isnan(), expected_best.isnan())
    finite = ~expected_best.isnan()
    assert torch.equal(best[finite], expected_best[finite])
    assert torch.equal(tokens[finite], expected_tokens[finite])
    assert tokens[1] == 3 and tokens[6] == 0 and tokens[7] == 0 and tokens[3] == 0
    wider = torch.cat([logits, torch.full((12, 5), -1e9)], dim=1)
    assert torch.equal(row_max(wider[:, :width])[1][finite], tokens[finite])  # rows that are a view read the same
