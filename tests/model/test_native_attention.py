"""kiln's native paged decode attention (kiln/kernels/native/paged_attention.cpp) against the traced torch form
(kiln.model.graph_attention.traced_decode_attention), on every ISA tier this CPU runs: every KV cache dtype
(float32, bfloat16, float16, and int8 and fp8_e4m3 codes with their scales: the traced form reads them dequantized),
GQA groups, head dims with and without a vector path, sliding windows, soft-caps, padding rows on the null block,
sequences long enough to be split across threads, a verification's rows read as one block of queries; the engine's
three ways to reach it (the paged-attention op of eager and piecewise steps, the full decode graph's node) give the
torch form's tokens; the plan's timed choice."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.kernels.attention import (
    NATIVE_PREFIX,
    TORCH,
    NativeDecode,
    choose_decode_attention,
    decode_kernel,
    native_kernels,
)
from kiln.kernels.choices import KernelChoiceCache
from kiln.kernels.native.build import native_op, runnable_tiers
from kiln.model.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from kiln.model.graph_attention import traced_decode_attention
from kiln.model.kv_format import STORAGE, pack_rows
from tests.compile.tiny import generate, graph_runner, make_runner, random_prompts, tiny_model

TIERS = [t.name for t in runnable_tiers() if native_op(t.name, "paged_decode_attention") is not None]
# (query heads, KV heads, head dim): the default model's, no grouping, a wide group, a head dim with no vector path
GEOMETRIES = [(9, 3, 64), (4, 4, 128), (8, 1, 32), (6, 2, 12)]
BLOCK = 16
NUM_BLOCKS = 200
# tokens of each row: one key, a block's edge, a long row split across threads, and a padding row (0: on the null
# block, seen as 1)
LENGTHS = [1, 16, 17, 130, 1500, 0]


def test_every_runnable_tier_loads_the_kernel() -> None:
    """The build compiles the attention source into every tier (a tier without it would silently run torch)."""
    assert [t.name for t in runnable_tiers()] == TIERS
    for dtype in STORAGE.values():  # every KV cache dtype has a native path
        assert native_kernels(dtype) == [NATIVE_PREFIX + TIERS[0]]
    assert native_kernels(torch.float64) == []  # no native path: the torch form runs


def _case(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    cache = pack_rows(torch.randn(2, kv_heads, NUM_BLOCKS + 1, BLOCK, head_dim, generator=gen) * 2, dtype)
    width = -(-max(LENGTHS) // BLOCK)
    table = torch.stack([torch.randperm(NUM_BLOCKS, generator=gen)[:width] for _ in LENGTHS])
    table[LENGTHS.index(0)] = NUM_BLOCKS  # the padding row reads the null block
    q = torch.randn(len(LENGTHS), heads * head_dim, generator=gen) * 2
    return q, cache, table, torch.tensor(LENGTHS)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "x".join(map(str, g)))
@pytest.mark.parametrize("dtype", list(STORAGE.values()), ids=list(STORAGE))
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (40, 0.0), (0, 5.0), (300, 5.0)])
def test_native_decode_equals_the_traced_form(
    tier: str, geometry: tuple[int, int, int], dtype: torch.dtype, window: int, softcap: float
) -> None:
    q, cache, table, seq_lens = _case(*geometry, dtype)
    want = traced_decode_attention(q, cache, table, seq_lens, window, softcap)
    got = NativeDecode(tier)(q, cache, table, seq_lens, window, softcap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if window:  # the window hides keys: the answer differs from global attention's where rows are longer
        wide = traced_decode_attention(q, cache, table, seq_lens, 0, softcap)
        assert (wide[4] - want[4]).abs().max() > 1e-3


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8], ids=["float32", "int8"])
def test_verification_rows_attend_as_one_block_with_the_same_numbers(tier: str, dtype: torch.dtype) -> None:
    """A verification's rows (one block table, consecutive lengths: read as one block of queries) give what each row
    gives alone and what the traced form gives, beside rows that only look alike (another table, a repeated length)."""
    q, cache, table, _ = _case(9, 3, 64, dtype, seed=3)
    base = table[4]  # the 1500-token row's blocks
    verify = [1200, 1201, 1202, 1203, 1204]
    rows = torch.stack([base] * 5 + [table[3], base, base])
    seq_lens = torch.tensor([*verify, 1205, 1205, 1205])  # another table at the next length; a repeated length
    q = torch.randn(len(rows), 9 * 64, generator=torch.Generator().manual_seed(4)) * 2
    together = NativeDecode(tier)(q, cache, rows, seq_lens, 0, 0.0)
    alone = torch.cat(
        [
            NativeDecode(tier)(q[i : i + 1], cache, rows[i : i + 1], seq_lens[i : i + 1], 0, 0.0)
            for i in range(len(rows))
        ]
    )
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)
    want = traced_decode_attention(q, cache, rows, seq_lens, 0, 0.0)
    torch.testing.assert_close(together, want, rtol=1e-5, atol=1e-5)
    assert (together[4] - together[0]).abs().max() > 1e-3  # each row sees its own keys


@pytest.mark.parametrize("tier", TIERS)
def test_splitting_keys_across_threads_changes_nothing(tier: str) -> None:
    q, cache, table, seq_lens = _case(9, 3, 64, torch.float32, seed=1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = NativeDecode(tier)(q, cache, table, seq_lens, 0, 0.0)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(NativeDecode(tier)(q, cache, table, seq_lens, 0, 0.0), whole, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tier", TIERS)
def test_bad_operands_are_refused_with_what_was_expected(tier: str) -> None:
    q, cache, table, seq_lens = _case(9, 3, 64, torch.float32)
    op = native_op(tier, "paged_decode_attention")
    with pytest.raises(RuntimeError, match="rows of 64 must be q's head_dim 32 "):
        op(q.view(len(LENGTHS), -1, 32), cache, table, seq_lens, 0, 0.0)
    codes = pack_rows(cache.view(2, 3, -1, BLOCK, 32), torch.int8)  # rows of 32 codes and their scale
    with pytest.raises(RuntimeError, match=r"rows of 36 must be q's head_dim 64 \+ 4 \(the scale\)"):
        op(q.view(len(LENGTHS), 9, 64), codes, table, seq_lens, 0, 0.0)
    with pytest.raises(RuntimeError, match="reads block 999 of a cache of 201"):
        op(q.view(len(LENGTHS), 9, 64), cache, table.index_fill(1, torch.tensor([0]), 999), seq_lens, 0, 0.0)
    with pytest.raises(RuntimeError, match="sequence 4 reads 1500 tokens, its block table 10 blocks of 16"):
        op(q.view(len(LENGTHS), 9, 64), cache, table[:, :10], seq_lens, 0, 0.0)
    with pytest.raises(RuntimeError, match="do not group over"):
        op(q.view(len(LENGTHS), 8, 72)[:, :, :64].contiguous(), cache, table, seq_lens, 0, 0.0)


def test_the_choice_is_timed_once_and_names_a_kernel_that_runs(tmp_path: Path) -> None:
    cache = KernelChoiceCache(tmp_path)
    kv = torch.zeros(2, 3, 8, BLOCK, 64)
    kernel, record = choose_decode_attention(kv, 9, cache, traced_decode_attention)
    assert set(record["times_us"]) == {TORCH, *native_kernels(torch.float32)}
    assert kernel == record["winner"] == min(record["times_us"], key=record["times_us"].get)
    again, second = choose_decode_attention(kv, 9, cache, traced_decode_attention)
    assert again == kernel and second["source"] == "process"
    wide, why = choose_decode_attention(kv.double(), 9, cache, traced_decode_attention)
    assert wide == TORCH and "no native kernel" in why["why"]
    fp8, record = choose_decode_attention(pack_rows(kv, torch.uint8), 9, cache, traced_decode_attention)
    assert record["source"] == "timed" and set(record["times_us"]) == {TORCH, *native_kernels(torch.uint8)}
    assert fp8 == record["winner"]  # fp8 codes are timed apart from the float32 cache (another key)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model(num_layers=3)


PROMPTS = random_prompts([5, 3, 9, 40])
MAX_TOKENS = 12


def _forced(monkeypatch: pytest.MonkeyPatch, kernel: str) -> None:
    """Every plan made from here on runs `kernel` (the test names it, whatever the timing would pick)."""
    monkeypatch.setattr("kiln.kernels.plan.choose_decode_attention", lambda *a: (kernel, {"winner": kernel}))


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_engine_tokens_equal_the_torch_forms(
    model: torch.nn.Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tier: str, mode: str
) -> None:
    expected = generate(make_runner(model), PROMPTS, MAX_TOKENS)  # eager, the torch form (plan left as is)
    _forced(monkeypatch, NATIVE_PREFIX + tier)
    runner, graph = graph_runner(model, tmp_path, compiler="inductor", mode=mode, capture_sizes=(1, 2, 4))
    assert graph.plan.decode_attention == NATIVE_PREFIX + tier
    assert generate(runner, PROMPTS, MAX_TOKENS) == expected
    if mode == "full_and_piecewise":
        assert graph.counters.full_replays > 0
        nodes = {str(n.target) for n in graph.full.piece.graph.graph.nodes if n.op == "call_function"}
        assert f"kiln_native_{tier}.paged_decode_attention" in nodes  # one node of the graph, not traced torch ops


def test_the_op_runs_the_context_kernel(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    """The paged-attention op reads the step's kernel from its forward context: a kernel the plan named but that
    cannot run here is an error that says so, never a silent torch fallback."""
    q = torch.randn(1, 64)
    kv = torch.zeros(2, 2, 5, 4, 16)
    meta = AttentionMetadata(1, 1, torch.tensor([0]), [0, 1], [1], torch.tensor([1]), torch.tensor([[0]]), 4)
    context = ForwardContext(meta, [kv], decode_kernel=decode_kernel(NATIVE_PREFIX + "nowhere"))
    with set_forward_context(context), pytest.raises(RuntimeError, match="native nowhere tier is not loaded here"):
        torch.ops.kiln.attention(q, q[:, :32], q[:, :32], 0)
    with pytest.raises(RuntimeError, match="native plain2 tier is not loaded here"):
        NativeDecode("plain2")(q, kv, torch.tensor([[0]]), torch.tensor([1]), 0, 0.0)
