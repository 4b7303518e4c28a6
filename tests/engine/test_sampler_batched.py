"""The batched sampler equals the row-by-row one it replaced (tests/engine/rowwise_sampler.py) for every
combination of settings in one batch: greedy tokens exactly, the filtered distributions exactly (so the sampled
rows draw from the same distributions), and the draw itself checked statistically; seeded rows repeat."""

from __future__ import annotations

import itertools
import math

import torch

from kiln.engine.sampling.sampler import CANDIDATES, Sampler, SamplingRow, apply_penalties, draw, filter_batch
from kiln.engine.sampling.sampling_params import SamplingParams
from tests.engine import rowwise_sampler
from tests.engine.rowwise_sampler import RowwiseSampler

VOCAB = 300
SETTINGS = [  # every filter alone, with the others, and with penalties and bias
    {"temperature": t, "top_k": k, "top_p": p, "min_p": m}
    for t, k, p, m in itertools.product((0.0, 0.7, 1.3), (0, 5, 299), (1.0, 0.8, 1e-46), (0.0, 0.1))
]
PENALTIES = [{}, {"repetition_penalty": 1.3}, {"presence_penalty": 0.5, "frequency_penalty": -0.4}]


def make_rows(seed: int) -> tuple[torch.Tensor, list[SamplingRow]]:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i, setting in enumerate(SETTINGS):
        extra = PENALTIES[i % len(PENALTIES)] | ({"logit_bias": {7: 3.0, 11: -50.0}} if i % 5 == 0 else {})
        params = SamplingParams(max_tokens=8, seed=i, **setting, **extra)
        prompt = torch.randint(VOCAB, (20,), generator=gen).tolist()
        output = torch.randint(VOCAB, (i % 7,), generator=gen).tolist()
        block = [3, 4] if i % 4 == 0 else []
        rows.append(SamplingRow(params, prompt, output, torch.Generator().manual_seed(i), block))
    return torch.randn(len(rows), VOCAB, generator=gen) * 3, rows


def test_greedy_rows_pick_exactly_what_the_rowwise_sampler_picks() -> None:
    for seed in range(5):
        logits, rows = make_rows(seed)
        mine, theirs = Sampler()(logits.clone(), rows), RowwiseSampler()(logits.clone(), rows)
        for row, a, b in zip(rows, mine.token_ids, theirs.token_ids, strict=True):
            if row.params.is_greedy:
                assert a == b
        assert mine.errors == theirs.errors


def test_the_filtered_distributions_are_the_rowwise_ones() -> None:
    for seed in range(5):
        logits, rows = make_rows(seed)
        penalised = apply_penalties(logits.clone(), rows)
        assert torch.equal(penalised, rowwise_sampler.apply_penalties(logits.clone(), rows))
        sampled = [r for r in rows if not r.params.is_greedy]
        index = torch.tensor([i for i, r in enumerate(rows) if not r.params.is_greedy])
        batched = filter_batch(penalised[index], [r.params for r in sampled]).softmax(-1)
        for row, got, x in zip(sampled, batched, penalised[index], strict=True):
            want = rowwise_sampler.filter_logits(x, row.params).softmax(-1)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_the_draw_follows_each_rows_distribution() -> None:
    """20,000 draws per row from three distributions at once: each token's frequency within 5 standard errors
    of its probability, and no token of probability 0 ever drawn."""
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0], [0.1, 0.0, 0.2, 0.3, 0.4]])
    generators = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    n = 20_000
    counts = torch.zeros_like(probs)
    for _ in range(n):
        tokens = draw(probs, generators)
        counts[torch.arange(3), tokens] += 1
    freq = counts / n
    assert torch.all(freq[probs == 0] == 0)
    for p, f in zip(probs.flatten().tolist(), freq.flatten().tolist(), strict=True):
        assert abs(f - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1e-9, (p, f)


def test_seeded_rows_repeat_and_seeds_differ() -> None:
    logits, rows = make_rows(0)

    def run(seed_offset: int) -> list[list[int]]:
        for i, row in enumerate(rows):
            row.generator = torch.Generator().manual_seed(i + seed_offset)
        return [Sampler()(logits.clone(), rows).token_ids for _ in range(10)]

    first, again, other = run(0), run(0), run(1000)
    assert first == again
    sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy and r.params.top_p > 1e-3]
    assert any(first[s][i] != other[s][i] for s in range(10) for i in sampled)


def test_rows_past_the_candidates_are_exact_too() -> None:
    """A vocabulary larger than the candidates: a flat row's nucleus reaches past them (its row is sorted whole),
    a peaked row's does not, and a top-k larger than the candidates widens them."""
    vocab = 3 * CANDIDATES
    gen = torch.Generator().manual_seed(7)
    flat, peaked = torch.randn(2, vocab, generator=gen) * 0.05, torch.randn(2, vocab, generator=gen) * 8
    logits = torch.cat([flat, peaked, flat[:1]])
    params = [
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.8, top_p=0.5, min_p=0.01),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.2, top_k=50, top_p=0.7),
        SamplingParams(temperature=1.0, top_k=CANDIDATES + 500),
    ]
    batched = filter_batch(logits, params)
    for row, got, x in zip(params, batched, logits, strict=True):
        want = rowwise_sampler.filter_logits(x, row)
        assert torch.equal(got.isfinite(), want.isfinite())
        torch.testing.assert_close(got.softmax(-1), want.softmax(-1), rtol=1e-5, atol=1e-7)
    assert int(batched[0].isfinite().sum()) > CANDIDATES  # the flat row's nucleus: past the candidates
    assert int(batched[4].isfinite().sum()) == CANDIDATES + 500
    rows = [SamplingRow(p, [1], [], torch.Generator().manual_seed(i), []) for i, p in enumerate(params)]
    for _ in range(50):  # what the sampler draws lies in each row's filtered support, whichever group it took
        tokens = Sampler()(logits.clone(), rows).token_ids
        assert all(bool(batched[i, t].isfinite()) for i, t in enumerate(tokens)), tokens
