"""Sliding-window attention in both attention paths against a dense reference over the un-paged K/V.

Two sequences (13 and 10 tokens, scattered over 4-token blocks) attend with a window of 5, which is not a
multiple of the block size, through the paged-attention op (whole prompts, chunked prefill, decode-only, mixed
and padded steps) and through the traced decode attention of full decode graphs (eager and `fullgraph=True`).
Window 0 is global attention: the same steps match the plain causal reference.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import kiln.model.attention  # noqa: F401  (registers torch.ops.kiln.attention)
from kiln.model.attention import kv_cache_shape
from kiln.model.forward_context import AttentionMetadata, DecodeInputs, ForwardContext, set_forward_context
from kiln.model.graph_attention import decode_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8
BLOCK_SIZE, NUM_BLOCKS = 4, 16
NULL_BLOCK = NUM_BLOCKS  # kv_cache_shape puts the null block last
WINDOW = 5
LENGTHS = (13, 10)
TABLES = ([3, 9, 0, 12], [5, 1, 14])  # each sequence's blocks, deliberately out of order

Step = list[tuple[int, int]]  # (sequence, new tokens) per scheduled sequence, decodes (1 token) first
QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """Every position of one whole sequence, un-paged: position i sees j iff j <= i and (window 0 or i - j < window)."""
    n = q.shape[0]
    qh = q.view(n, NUM_HEADS, HEAD_DIM).transpose(0, 1)
    group = NUM_HEADS // NUM_KV_HEADS
    kh = k.view(n, NUM_KV_HEADS, HEAD_DIM).transpose(0, 1).repeat_interleave(group, 0)
    vh = v.view(n, NUM_KV_HEADS, HEAD_DIM).transpose(0, 1).repeat_interleave(group, 0)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allowed = (j <= i) & ((i - j < window) if window else True)
    scores = (qh @ kh.transpose(-1, -2) * HEAD_DIM**-0.5).masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ vh).transpose(0, 1).reshape(n, NUM_HEADS * HEAD_DIM)


def sequences() -> list[QKV]:
    """q, k, v of every position of each sequence."""
    gen = torch.Generator().manual_seed(0)
    return [
        tuple(torch.randn(n, h * HEAD_DIM, generator=gen) for h in (NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS))
        for n in LENGTHS
    ]


def random_cache() -> torch.Tensor:
    """Random, not zeros: a key the mask should hide but does not changes the output."""
    gen = torch.Generator().manual_seed(1)
    return torch.randn(kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), generator=gen)


def slot(seq: int, pos: int) -> int:
    return TABLES[seq][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE


def step_metadata(entries: list[tuple[int, int, int]]) -> AttentionMetadata:
    """One step's layout over (sequence, context, new tokens) entries, decodes first."""
    starts, seq_lens = [0], []
    for _, context, new in entries:
        starts.append(starts[-1] + new)
        seq_lens.append(context + new)
    width = max(len(t) for t in TABLES)
    tables = [TABLES[s] + [0] * (width - len(TABLES[s])) for s, _, _ in entries]
    num_decodes = next((i for i, (_, c, new) in enumerate(entries) if new != 1 or c == 0), len(entries))
    return AttentionMetadata(
        num_actual_tokens=starts[-1],
        num_decodes=num_decodes,
        slot_mapping=torch.tensor([slot(s, p) for s, c, new in entries for p in range(c, c + new)]),
        query_start_loc=starts,
        seq_lens=seq_lens,
        seq_lens_tensor=torch.tensor(seq_lens),
        block_tables=torch.tensor(tables),
        block_size=BLOCK_SIZE,
    )


def run_op(steps: list[Step], window: int, pad: int = 0) -> None:
    """Runs `steps` through the paged-attention op (`pad` padding rows each) and checks every real row against the
    dense reference; padding rows give zeros."""
    seqs, cache = sequences(), random_cache()
    want = [dense_attention(*qkv, window) for qkv in seqs]
    context = [0] * len(seqs)
    gen = torch.Generator().manual_seed(2)
    for step in steps:
        entries = [(s, context[s], new) for s, new in step]
        meta = step_metadata(entries)
        q, k, v = (
            torch.cat([seqs[s][t][c : c + new] for s, c, new in entries] + [torch.randn(pad, w, generator=gen)])
            for t, w in enumerate((NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM))
        )
        with set_forward_context(ForwardContext(meta, [cache])):
            out = torch.ops.kiln.attention(q, k, v, 0, window)
        for (s, c, new), start in zip(entries, meta.query_start_loc[:-1], strict=True):
            torch.testing.assert_close(out[start : start + new], want[s][c : c + new], rtol=0, atol=1e-5)
            context[s] += new
        assert not out[meta.num_actual_tokens :].any()


STEPS = {
    "whole_prompts": [[(0, 13), (1, 10)]],
    "chunked_prefill": [[(0, 6), (1, 3)], [(0, 4), (1, 7)], [(0, 3)]],
    "decode_only": [[(0, 8), (1, 6)]] + [[(0, 1), (1, 1)]] * 4 + [[(0, 1)]],
    "decodes_beside_chunks": [[(0, 8)], [(0, 1), (1, 5)], [(0, 1), (1, 3)], [(0, 1), (1, 1)], [(0, 1), (1, 1)]],
}


@pytest.mark.parametrize("window", [WINDOW, 0])
@pytest.mark.parametrize("name", list(STEPS))
def test_the_op_matches_dense_attention(name: str, window: int) -> None:
    run_op(STEPS[name], window)


@pytest.mark.parametrize("window", [WINDOW, 0])
def test_padded_steps_match_dense_attention(window: int) -> None:
    run_op(STEPS["decode_only"], window, pad=2)
    run_op(STEPS["chunked_prefill"], window, pad=3)


def test_window_0_is_the_default_and_a_window_past_the_prompt_is_global() -> None:
    q, k, v = sequences()[0]
    with set_forward_context(ForwardContext(step_metadata([(0, 0, LENGTHS[0])]), [random_cache()])):
        default = torch.ops.kiln.attention(q, k, v, 0)
        zero = torch.ops.kiln.attention(q, k, v, 0, 0)
        wide = torch.ops.kiln.attention(q, k, v, 0, 64)
    assert torch.equal(default, zero)
    torch.testing.assert_close(wide, default, rtol=0, atol=1e-6)


def run_graph_decode(attend: Callable[..., torch.Tensor], window: int) -> None:
    """Prefills 8 and 6 tokens with the op, then decodes to the sequences' ends with `attend` (the traced decode
    attention) over a fixed-width table, one padding row (the null block) in every step."""
    seqs, cache = sequences(), random_cache()
    want = [dense_attention(*qkv, window) for qkv in seqs]
    context = [8, 6]
    meta = step_metadata([(0, 0, context[0]), (1, 0, context[1])])
    q, k, v = (torch.cat([seqs[s][t][: context[s]] for s in (0, 1)]) for t in range(3))
    with set_forward_context(ForwardContext(meta, [cache])):
        torch.ops.kiln.attention(q, k, v, 0, window)
    width = 5  # blocks: wider than the longest sequence needs, as a decode graph's table is
    table = torch.tensor([t + [NULL_BLOCK] * (width - len(t)) for t in TABLES] + [[NULL_BLOCK] * width])
    while context[0] < LENGTHS[0]:
        live = [s for s in (0, 1) if context[s] < LENGTHS[s]]
        seq_lens = torch.tensor([context[s] + 1 for s in live] + [1])
        decode = DecodeInputs(seq_lens, table[[*live, 2]])
        q, k, v = (
            torch.cat([seqs[s][t][context[s] : context[s] + 1] for s in live] + [seqs[0][t][:1]]) for t in range(3)
        )
        out = attend(q, k, v, cache, decode, window)
        for row, s in enumerate(live):
            torch.testing.assert_close(out[row], want[s][context[s]], rtol=0, atol=1e-5)
            context[s] += 1
        assert out[len(live)].isfinite().all()


@pytest.mark.parametrize("window", [WINDOW, 0])
def test_traced_decode_attention_matches_dense_attention(window: int) -> None:
    run_graph_decode(decode_attention, window)


@pytest.mark.parametrize("window", [WINDOW, 0])
def test_traced_decode_attention_traces_whole(window: int) -> None:
    """`fullgraph=True`: the window adds no graph break (the full decode graph holds no opaque op)."""
    run_graph_decode(torch.compile(decode_attention, fullgraph=True, backend="eager", dynamic=False), window)
