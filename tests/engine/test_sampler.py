"""The sampler's filters on one row: every in-range value is served."""

from __future__ import annotations

import torch

from kiln.engine.sampler import filter_logits
from kiln.engine.sampling_params import SamplingParams


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
