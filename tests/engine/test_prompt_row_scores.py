"""The numbers prompt logprobs keep of each row of logits (kiln.engine.running.prompt_logprobs.row_scores): kiln's
native two-pass kernel equals torch's log-softmax, ranks and max on rows with ties, vocabularies that are not a
multiple of the kernel's vector width and very negative logits; and scoring in slices gives every slice size the same
entries as one log-softmax over all rows."""

from __future__ import annotations

import pytest
import torch

from kiln.engine.running.prompt_logprobs import native_row_scores, row_scores, score_prompt_rows, torch_row_scores
from kiln.engine.running.step_plan import PromptRows


def _logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 5
    logits[0, vocab // 2] = logits[0, vocab // 3] = logits[0].max() + 1  # two tied largest logits: the first wins
    logits[-1, : vocab // 2] = -200.0  # exp underflows: the sum must not change
    logits[1 % rows, :] = logits[1 % rows, 0]  # a row of one value: rank 1 for every target, index 0
    return logits


@pytest.mark.parametrize("vocab", [1, 7, 16, 37, 4099])
def test_native_row_scores_equal_torch_ops(vocab: int) -> None:
    op = native_row_scores()
    assert op is not None, "every ISA tier builds prompt_row_scores (`make setup` / `kiln kernels build`)"
    logits = _logits(rows=6, vocab=vocab, seed=vocab)
    targets = torch.randint(0, vocab, (6,), generator=torch.Generator().manual_seed(1))
    targets[0] = vocab // 2  # the target is the (tied) largest logit
    lse, chosen, rank, top, index = op(logits, targets)
    want_lse, want_chosen, want_rank, want_top, want_index = torch_row_scores(logits, targets)
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)
    assert torch.equal(chosen, want_chosen) and torch.equal(rank, want_rank)
    assert torch.equal(top, want_top) and torch.equal(index, want_index)


def test_native_row_scores_refuses_targets_outside_the_vocabulary() -> None:
    assert native_row_scores() is not None, "every ISA tier builds prompt_row_scores"
    with pytest.raises(RuntimeError, match="target 9 of row 1 is outside the vocabulary of 9"):
        row_scores(torch.zeros(2, 9), torch.tensor([0, 9]))


@pytest.mark.parametrize("slice_rows", [1, 3, 5, 64])
@pytest.mark.parametrize("num_top", [0, 1, 3])
def test_sliced_scores_equal_one_log_softmax(slice_rows: int, num_top: int) -> None:
    """Two requests' rows in one step (the second's cut by slice boundaries at every size tried): each position's
    logprob, rank and top entries are those of a log-softmax over the whole hidden state at once."""
    hidden = torch.randn(12, 8, generator=torch.Generator().manual_seed(2))
    weight = torch.randn(300, 8, generator=torch.Generator().manual_seed(3))
    chunks = [PromptRows("a", 1, 4, [5, 299, 0], num_top), PromptRows("b", 4, 1, [7, 7, 100, 2, 250, 3, 9], num_top)]
    scores = score_prompt_rows(lambda h, rows: h[rows] @ weight.T, hidden, chunks, slice_rows=slice_rows)
    expected = torch.log_softmax(hidden @ weight.T, dim=-1)
    for chunk in chunks:
        got = scores[chunk.request_id]
        assert got.position == chunk.position and len(got.entries) == len(chunk.targets)
        for i, (token, entry) in enumerate(zip(chunk.targets, got.entries, strict=True)):
            row = expected[chunk.first_row + i]
            assert next(iter(entry)) == token
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            ranked = sorted((lp.rank, t) for t, lp in entry.items() if t != token or lp.rank <= num_top)
            assert [t for _, t in ranked][:num_top] == row.topk(num_top).indices.tolist()
            for t, lp in entry.items():
                assert abs(lp.logprob - row[t].item()) < 1e-5
            assert len(entry) <= num_top + 1
