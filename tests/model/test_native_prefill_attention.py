"""kiln's native paged prefill attention (kiln/kernels/native/paged_attention.cpp, `paged_prefill_attention`) against
the arithmetic spelled out in float64 and the grouped torch form (kiln.model.prefill_attention), on every ISA tier
this CPU runs: every KV cache dtype, GQA groups, head dims with and without a vector path, sliding windows,
soft-caps; fresh prompts longer than a block of queries, chunks over a cached context long enough to be split across
threads, one-token chunks; the same numbers as the decode op row by row; the engine's tokens with it (chunked
prefill beside decodes, eager and piecewise); the plan's timed choice."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from kiln.kernels.attention import (
    NATIVE_PREFIX,
    TORCH,
    NativeDecode,
    NativePrefill,
    choose_prefill_attention,
    native_kernels,
)
from kiln.kernels.choices import KernelChoiceCache
from kiln.kernels.native.build import native_op, runnable_tiers
from kiln.model.kv_format import STORAGE, cache_head_dim, pack_rows, unpack_rows
from kiln.model.prefill_attention import grouped_prefill_attention
from tests.compile.tiny import generate, graph_runner, make_runner, random_prompts, tiny_model

TIERS = [t.name for t in runnable_tiers() if native_op(t.name, "paged_prefill_attention") is not None]
# (query heads, KV heads, head dim): the default model's, no grouping, a wide group, a head dim with no vector path
GEOMETRIES = [(9, 3, 64), (4, 4, 128), (8, 1, 32), (6, 2, 12)]
BLOCK = 16
# (new tokens, tokens in all) per sequence: a short fresh prompt, one token over a context, a fresh prompt longer
# than a block of queries (64 vectors: 21 tokens of a group of 3), a chunk over a context long enough to be split
# across threads (and its scores taken in spans), a long chunk over a cached prefix
SEQUENCES = [(5, 5), (1, 20), (130, 130), (17, 1500), (300, 700)]


def _case(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """(q [tokens, heads * head_dim], cache, block_table, seq_lens, query_start): SEQUENCES over shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    widths = [-(-total // BLOCK) for _, total in SEQUENCES]
    blocks = sum(widths)
    cache = pack_rows(torch.randn(2, kv_heads, blocks + 1, BLOCK, head_dim, generator=gen) * 2, dtype)
    order = torch.randperm(blocks, generator=gen)
    table = torch.zeros(len(SEQUENCES), max(widths), dtype=torch.long)
    for i, (width, first) in enumerate(zip(widths, itertools.accumulate([0, *widths]), strict=False)):
        table[i, :width] = order[first : first + width]
    q = torch.randn(sum(new for new, _ in SEQUENCES), heads * head_dim, generator=gen) * 2
    seq_lens = torch.tensor([total for _, total in SEQUENCES])
    query_start = torch.tensor([0, *itertools.accumulate(new for new, _ in SEQUENCES)])
    return q, cache, table, seq_lens, query_start


def reference(
    q: torch.Tensor,
    cache: torch.Tensor,
    table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    window: int,
    softcap: float,
) -> torch.Tensor:
    """The arithmetic spelled out in float64, one sequence at a time: each query over its visible stored keys."""
    kv_heads, head_dim = cache.shape[1], cache_head_dim(cache)
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, total in enumerate(seq_lens.tolist()):
        start, end = int(query_start[i]), int(query_start[i + 1])
        rows = cache[:, :, table[i, : -(-total // BLOCK)]].flatten(2, 3)[:, :, :total]
        k, v = unpack_rows(rows, torch.float32).double()  # [kv_heads, total, head_dim] each
        qi = q[start:end].double().view(end - start, kv_heads, -1, head_dim)  # [new, kv_heads, group, head_dim]
        scores = torch.einsum("nhgd,htd->nhgt", qi, k) / head_dim**0.5
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        position = torch.arange(total - (end - start), total)[:, None]
        keys = torch.arange(total)[None, :]
        hidden = (keys > position) | ((keys <= position - window) if window else False)
        weights = scores.masked_fill(hidden[:, None, None, :], float("-inf")).softmax(-1)
        out[start:end] = torch.einsum("nhgt,htd->nhgd", weights, v).flatten(1)
    return out.float()


def test_every_runnable_tier_loads_the_kernel() -> None:
    assert [t.name for t in runnable_tiers()] == TIERS
    for dtype in STORAGE.values():
        assert native_kernels(dtype, "paged_prefill_attention") == [NATIVE_PREFIX + TIERS[0]]


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "x".join(map(str, g)))
@pytest.mark.parametrize("dtype", list(STORAGE.values()), ids=list(STORAGE))
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (40, 0.0), (0, 5.0), (300, 5.0)])
def test_native_prefill_equals_the_reference_and_the_grouped_form(
    tier: str, geometry: tuple[int, int, int], dtype: torch.dtype, window: int, softcap: float
) -> None:
    q, cache, table, seq_lens, query_start = _case(*geometry, dtype)
    want = reference(q, cache, table, seq_lens, query_start, window, softcap)
    got = NativePrefill(tier)(q, cache, table, seq_lens, query_start, window, softcap)
    # float32 scores of 128-term products at this scale (std ~4) round by ~3e-5: the plain tier's lanes reach 2e-5
    torch.testing.assert_close(got, want, rtol=1e-5, atol=3e-5)
    grouped = grouped_prefill_attention(q, cache, table, seq_lens, query_start, window, softcap)
    torch.testing.assert_close(grouped, want, rtol=1e-4, atol=1e-4)  # SDPA's own rounding
    if window:  # the window hides keys: the chunk over the long context attends differently
        wide = reference(q, cache, table, seq_lens, query_start, 0, softcap)
        rows = slice(int(query_start[3]), int(query_start[4]))
        assert (wide[rows] - want[rows]).abs().max() > 1e-3


@pytest.mark.parametrize("tier", TIERS)
def test_each_query_equals_a_decode_row_at_its_position(tier: str) -> None:
    """A prompt's query at position p attends as a decode row of p + 1 tokens over the same blocks: the two native
    ops agree row by row (one walk, blocks of queries or rows of one)."""
    q, cache, table, seq_lens, query_start = _case(9, 3, 64, torch.bfloat16, seed=2)
    rows, positions = [], []
    for i, (new, total) in enumerate(SEQUENCES):
        rows += [i] * new
        positions += range(total - new + 1, total + 1)
    decoded = NativeDecode(tier)(q, cache, table[rows], torch.tensor(positions), 40, 0.0)
    prefilled = NativePrefill(tier)(q, cache, table, seq_lens, query_start, 40, 0.0)
    torch.testing.assert_close(prefilled, decoded, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tier", TIERS)
def test_splitting_keys_across_threads_changes_nothing(tier: str) -> None:
    q, cache, table, seq_lens, query_start = _case(9, 3, 64, torch.float32, seed=1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = NativePrefill(tier)(q, cache, table, seq_lens, query_start, 0, 0.0)
    finally:
        torch.set_num_threads(threads)
    split = NativePrefill(tier)(q, cache, table, seq_lens, query_start, 0, 0.0)
    torch.testing.assert_close(split, whole, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tier", TIERS)
def test_bad_operands_are_refused_with_what_was_expected(tier: str) -> None:
    q, cache, table, seq_lens, query_start = _case(9, 3, 64, torch.float32)
    op = native_op(tier, "paged_prefill_attention")
    q3 = q.view(q.shape[0], 9, 64)
    with pytest.raises(RuntimeError, match="query_start must run from 0 to q's 453 tokens"):
        op(q3, cache, table, seq_lens, query_start + 1, 0, 0.0)
    with pytest.raises(RuntimeError, match="sequence 0 has 5 queries of 4 tokens"):
        op(q3, cache, table, seq_lens - torch.tensor([1, 0, 0, 0, 0]), query_start, 0, 0.0)
    with pytest.raises(RuntimeError, match=r"seq_lens \[sequences\] and query_start \[sequences \+ 1\]"):
        op(q3, cache, table, seq_lens, query_start[:-1], 0, 0.0)
    with pytest.raises(RuntimeError, match="sequence 3 reads block 999 of a cache of"):
        op(
            q3,
            cache,
            table.index_put((torch.tensor([3]), torch.tensor([0])), torch.tensor(999)),
            seq_lens,
            query_start,
            0,
            0.0,
        )


def test_the_choice_is_timed_once_and_names_a_kernel_that_runs(tmp_path: Path) -> None:
    cache = KernelChoiceCache(tmp_path)
    kv = torch.zeros(2, 3, 8, BLOCK, 64)
    kernel, record = choose_prefill_attention(kv, 9, cache, grouped_prefill_attention)
    assert set(record["times_us"]) == {TORCH, *native_kernels(torch.float32, "paged_prefill_attention")}
    assert kernel == record["winner"] == min(record["times_us"], key=record["times_us"].get)
    again, second = choose_prefill_attention(kv, 9, cache, grouped_prefill_attention)
    assert again == kernel and second["source"] == "process"
    wide, why = choose_prefill_attention(kv.double(), 9, cache, grouped_prefill_attention)
    assert wide == TORCH and "no native kernel" in why["why"]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model(num_layers=3)


# prompts chunked 16 tokens a step: later chunks attend over their earlier ones beside the others' decodes
PROMPTS = random_prompts([5, 3, 9, 40, 70])
MAX_TOKENS = 10
CHUNKED = {"max_num_batched_tokens": 16}


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("mode", ["eager", "piecewise"])
def test_engine_tokens_equal_the_grouped_form(
    model: torch.nn.Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tier: str, mode: str
) -> None:
    expected = generate(make_runner(model), PROMPTS, MAX_TOKENS, **CHUNKED)  # eager, the torch forms
    kernel = NATIVE_PREFIX + tier
    monkeypatch.setattr("kiln.kernels.plan.choose_prefill_attention", lambda *a: (kernel, {"winner": kernel}))
    if mode == "eager":
        runner = make_runner(model)
        runner.executor.plan.prefill_attention = kernel
    else:
        runner, graph = graph_runner(model, tmp_path, compiler="inductor", mode=mode)
        assert graph.plan.prefill_attention == kernel
    calls = []
    run = NativePrefill.__call__
    monkeypatch.setattr(NativePrefill, "__call__", lambda self, *a, **k: calls.append(1) or run(self, *a, **k))
    assert generate(runner, PROMPTS, MAX_TOKENS, **CHUNKED) == expected
    assert calls  # the prompts' attention ran on the native kernel
