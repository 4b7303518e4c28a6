"""Prompt logprobs without the logits (kiln.kernels.head `LogitsHead.score_rows`, kiln's native `head_row_scores`):
the numbers equal those of the bf16 head's logits scored by `prompt_row_scores`: the same target logit bit for bit (so
the same rank where logits tie with it), the first of tied largest logits, any row and vocabulary count; a packed head
offers its bf16 copy only for a row class bound to the bf16 form; the slices of `score_prompt_rows` give the entries
the logits give, and a request asking for several alternatives (a top-k of the logits) takes the logits' path. Where
the op does not load here (no AVX-512 tier, no bf16 brgemm), each test asserts that instead."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from gguf import GGMLQuantizationType

from kiln.engine.running.prompt_logprobs import FUSED_SLICE_ROWS, row_scores, score_prompt_rows
from kiln.engine.running.step_plan import PromptRows
from kiln.kernels.compute_forms import Bf16Form, brgemm_bf16_op, pack_dense_bf16
from kiln.kernels.head import LogitsHead, native_head_scores
from kiln.kernels.native.build import native_op, runnable_tiers
from kiln.quant import ops
from kiln.quant.linear import PackedLinear
from tests.quant.test_packed import _packed


def native_or_refused():
    """The native op; where it does not load, asserts that no tier this CPU runs offers it with a bf16 brgemm."""
    op = native_head_scores()
    if op is None:
        offered = [native_op(tier.name, "head_row_scores") for tier in runnable_tiers()]
        assert brgemm_bf16_op() is None or all(o is None for o in offered)
    return op


def _head(vocab: int, hidden: int, seed: int) -> torch.Tensor:
    weight = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(seed)) * 0.2
    weight[vocab // 2] = weight[vocab // 3] = weight[0] * 3  # two rows that tie: their logits are equal in every row
    return weight


@pytest.mark.parametrize(("rows", "vocab"), [(1, 37), (5, 300), (33, 4099), (70, 1000)])
def test_the_fused_scores_equal_the_bf16_logits_scored(rows: int, vocab: int) -> None:
    op = native_or_refused()
    if op is None:
        return
    weight = _head(vocab, 64, seed=rows)
    packed = pack_dense_bf16(weight)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(vocab))
    x[0] = weight[0].sign()  # row 0's largest logits are the two tied rows: the first index wins
    targets = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(7))
    targets[0] = vocab // 2  # a target that ties with the largest: neither counts above the other
    got = op(x, packed, vocab, targets)
    want = row_scores(brgemm_bf16_op()(x, packed, vocab), targets)
    lse, chosen, rank, top, index = got
    torch.testing.assert_close(lse, want[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(chosen, want[1]) and torch.equal(rank, want[2])
    assert torch.equal(top, want[3]) and torch.equal(index, want[4])
    assert int(index[0]) == vocab // 3 and int(rank[0]) == 1


def test_targets_outside_the_vocabulary_are_refused() -> None:
    op = native_or_refused()
    if op is None:
        return
    with pytest.raises(RuntimeError, match="target 40 of row 1 is outside the vocabulary of 40"):
        op(torch.zeros(2, 64), pack_dense_bf16(torch.zeros(40, 64)), 40, torch.tensor([0, 40]))


def test_a_packed_head_offers_its_bf16_copy_for_the_classes_bound_to_it() -> None:
    op = native_or_refused()
    if op is None:
        return
    head = PackedLinear(128, 48, bits=4)
    head.load_rows(0, _packed(GGMLQuantizationType.Q4_1, 48, 128, 3))
    weight = (head.codes, head.scale, head.offset)
    form = Bf16Form([weight])
    ops.bind_kernels(head.codes, {64: form})
    logits_head = LogitsHead(SimpleNamespace(lm_head=head))
    copy, outputs = logits_head.bf16_form(64)
    assert copy is form.copies[head.codes.data_ptr()] and outputs == 48
    assert logits_head.bf16_form(1) is None  # a class bound to no bf16 form (the reference product)
    assert logits_head.score_rows(torch.zeros(2, 128), torch.tensor([0, 1]), timed_rows=1) is None
    x, targets = torch.randn(40, 128), torch.randint(0, 48, (40,))
    got = logits_head.score_rows(x, targets, timed_rows=64)
    want = row_scores(form(x, *weight).float(), targets)
    assert got is not None and all(torch.equal(a, b) for a, b in zip(got[1:], want[1:], strict=True))
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_top", [0, 1, 3])
def test_fused_slices_give_the_entries_the_logits_give(num_top: int) -> None:
    """Two requests' rows, more than one fused slice of them: the fused path's entries equal the logits' path's
    (the same bf16 head); asked for three alternatives, the step takes the logits' path and never calls it."""
    op = native_or_refused()
    if op is None:
        return
    vocab = 500
    weight = _head(vocab, 64, seed=11)
    packed = pack_dense_bf16(weight)
    hidden = torch.randn(FUSED_SLICE_ROWS + 60, 64, generator=torch.Generator().manual_seed(5))
    a_targets = torch.randint(0, vocab, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    b_targets = torch.randint(0, vocab, (FUSED_SLICE_ROWS - 50,), generator=torch.Generator().manual_seed(2)).tolist()
    chunks = [PromptRows("a", 3, 4, a_targets, num_top), PromptRows("b", 110, 1, b_targets, num_top)]
    calls: list[int] = []

    def fused(rows: torch.Tensor, targets: torch.Tensor):
        calls.append(rows.shape[0])
        return op(rows, packed, vocab, targets)

    def head(h: torch.Tensor, rows: list[int]) -> torch.Tensor:
        return brgemm_bf16_op()(h[rows], packed, vocab)

    got = score_prompt_rows(head, hidden, chunks, slice_rows=64, fused=fused)
    want = score_prompt_rows(head, hidden, chunks, slice_rows=64)
    assert calls == ([FUSED_SLICE_ROWS, 100 + FUSED_SLICE_ROWS - 50 - FUSED_SLICE_ROWS] if num_top <= 1 else [])
    for chunk in chunks:
        for mine, theirs in zip(got[chunk.request_id].entries, want[chunk.request_id].entries, strict=True):
            assert mine.keys() == theirs.keys()
            for token, lp in mine.items():
                assert lp.rank == theirs[token].rank and abs(lp.logprob - theirs[token].logprob) < 1e-5


def test_a_head_without_the_fused_path_scores_in_timed_slices() -> None:
    """`fused` answering None (a head whose timed class runs another form): the logits' path, in `slice_rows`
    slices (above them the head's kernels were not timed)."""
    weight = torch.randn(50, 8, generator=torch.Generator().manual_seed(4))
    hidden = torch.randn(100, 8, generator=torch.Generator().manual_seed(6))
    chunks = [PromptRows("a", 0, 1, list(range(40)) * 2, 1)]
    sizes: list[int] = []

    def head(h: torch.Tensor, rows: list[int]) -> torch.Tensor:
        sizes.append(len(rows))
        return h[rows] @ weight.T

    scores = score_prompt_rows(head, hidden, chunks, slice_rows=32, fused=lambda rows, targets: None)
    assert sizes == [32, 32, 16]
    expected = torch.log_softmax(hidden[:80] @ weight.T, dim=-1)
    for i, (token, entry) in enumerate(zip(chunks[0].targets, scores["a"].entries, strict=True)):
        assert abs(entry[token].logprob - expected[i, token].item()) < 1e-5
