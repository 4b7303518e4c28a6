"""HF's rank of a prompt token, up to ties within rounding: kiln's logprobs and HF's agree to ~1e-5 (the tests hold
them to TIE), so among a tiny random model's tens of thousands of logprobs a few may lie that close to the token's,
and either order of those is right."""

from __future__ import annotations

import torch

TIE = 1e-4  # the logprob tolerance the prompt-logprob tests hold kiln to


def assert_rank_as_hf(rank: int, row: torch.Tensor, token: int) -> None:
    """`rank` (1 = the most likely) is `token`'s in HF's logprobs `row`, counting the tokens within TIE of it either
    way."""
    target = row[token]
    above = int((row > target + TIE).sum())  # surely more likely
    within = int((row > target - TIE).sum())  # more likely, or tied within rounding (the token itself included)
    assert above + 1 <= rank <= within, (rank, above + 1, within)
