"""Graph modes by name: the full decode graph (attention traced inside it) beside the pieces, in every mode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.compile.decode_buffers import width_buckets
from kiln.engine.running.model_runner import StepObserver
from kiln.graph_mode import GRAPH_MODES, GraphMode
from kiln.model.attention import null_block
from kiln.model.forward_context import AttentionMetadata, ForwardContext, ModelInputs, set_forward_context
from tests.compile.tiny import BLOCK_SIZE, generate, graph_runner, make_runner, random_prompts, tiny_model

PROMPTS = random_prompts([5, 3, 9])  # one 17-token prefill step, then decode-only steps of 3 (padded to 4)
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model(num_layers=3)


@pytest.fixture(scope="module")
def expected(model: torch.nn.Module) -> list[list[int]]:
    return generate(make_runner(model), PROMPTS, MAX_TOKENS)


class LogitsRecorder(StepObserver):
    def __init__(self) -> None:
        self.logits: list[torch.Tensor] = []

    def begin_step(self, batch: ModelInputs) -> None:
        pass

    def end_step(self, logits: torch.Tensor | None) -> None:
        if logits is not None:
            self.logits.append(logits.clone())


# the graph each step ran: 1 prefill step (17 tokens, above the largest capture size), 5 decode-only steps
STEP_COUNTERS = {
    "piecewise": dict(graphs_traced=1, replays=5, dynamic_fallbacks=1, full_replays=0, full_fallbacks_mixed=0),
    "full_and_piecewise": dict(graphs_traced=2, replays=0, dynamic_fallbacks=1, full_replays=5, full_fallbacks_mixed=1),
    "full_decode_only": dict(graphs_traced=2, replays=0, dynamic_fallbacks=1, full_replays=5, full_fallbacks_mixed=1),
    "full": dict(graphs_traced=2, replays=0, dynamic_fallbacks=1, full_replays=5, full_fallbacks_mixed=1),
}


@pytest.mark.parametrize("mode", [m for m in GRAPH_MODES if GraphMode(m).is_graph])
def test_every_mode_gives_eager_tokens_and_counts_which_graph_ran(
    model: torch.nn.Module, expected: list[list[int]], cache_dir: Path, mode: str
) -> None:
    runner, graph = graph_runner(model, cache_dir, compiler="eager", mode=mode)
    assert graph.counters.pieces_captured == (12 if mode in ("piecewise", "full_and_piecewise") else 0)
    assert generate(runner, PROMPTS, MAX_TOKENS) == expected
    graph.counters.expect(**STEP_COUNTERS[mode], full_fallbacks_size=0)
    assert graph.dispatcher.last[0] == ("piecewise" if mode == "piecewise" else "full")


@pytest.mark.parametrize("mode", ["full_and_piecewise", "full_decode_only"])
def test_mixed_steps_run_the_pieces_and_decode_steps_the_full_graph(
    model: torch.nn.Module, cache_dir: Path, mode: str
) -> None:
    """Chunked prefill (6 tokens a step) mixes prefill chunks with decodes: those steps fall back, with the reason."""
    want = generate(make_runner(model), PROMPTS, MAX_TOKENS, max_num_batched_tokens=6)
    runner, graph = graph_runner(model, cache_dir, compiler="eager", mode=mode)
    assert generate(runner, PROMPTS, MAX_TOKENS, max_num_batched_tokens=6) == want
    c = graph.counters
    assert c.full_replays > 0 and c.full_fallbacks_mixed > 0 and c.full_fallbacks_size == 0
    assert c.full_fallbacks_mixed == c.replays + c.dynamic_fallbacks  # every other step held a prefill
    assert c.replays == (c.full_fallbacks_mixed - c.dynamic_fallbacks if mode == "full_and_piecewise" else 0)


def test_full_decode_graph_logits_match_eager_in_fp32_without_recompiling(
    model: torch.nn.Module, cache_dir: Path
) -> None:
    """Inductor-compiled full graph: every step's logits within 1e-4 of eager, across table widths 1..5 blocks."""
    eager, got = LogitsRecorder(), LogitsRecorder()
    ref = make_runner(model)
    ref.observer = eager
    runner, graph = graph_runner(model, cache_dir, compiler="inductor", mode="full_and_piecewise")
    runner.observer = got
    compiled = graph.counters.pieces_compiled
    prompts = random_prompts([2, 7, 13], seed=3)
    assert generate(runner, prompts, 8) == generate(ref, prompts, 8)
    assert len(got.logits) == len(eager.logits) == 8
    for g, w in zip(got.logits, eager.logits, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-4)
    graph.counters.expect(full_replays=7, pieces_compiled=compiled, graphs_traced=2)
    assert graph.full.buffers.uploads == 7  # one host->device copy per full-graph step


def test_the_full_decode_graph_holds_no_opaque_attention(model: torch.nn.Module, cache_dir: Path) -> None:
    _, graph = graph_runner(model, cache_dir, compiler="inductor", mode="full_and_piecewise")
    full = graph.full
    calls = {str(n.target) for n in full.piece.graph.graph.nodes if n.op in ("call_function", "call_method")}
    assert not any("kiln.attention" in c for c in calls)
    assert "index_copy_" in calls  # the KV-cache write is traced too
    source = full.piece.compiled.source_code
    assert source and "kiln.attention" not in source and "kiln::attention" not in source
    split_calls = {str(n.target) for n in graph.graph.traced.gm.graph.nodes}
    assert any("kiln.attention" in c for c in split_calls)  # the pieces still split at the op


def _decode_step(seq_lens: list[int], tables: list[list[int]], size: int) -> ModelInputs:
    n = len(seq_lens)
    slots = [
        t[(s - 1) // BLOCK_SIZE] * BLOCK_SIZE + (s - 1) % BLOCK_SIZE for s, t in zip(seq_lens, tables, strict=True)
    ]
    meta = AttentionMetadata(
        num_actual_tokens=n,
        num_decodes=n,
        slot_mapping=torch.tensor(slots),
        query_start_loc=list(range(n + 1)),
        seq_lens=seq_lens,
        seq_lens_tensor=torch.tensor(seq_lens),
        block_tables=torch.tensor(tables),
        block_size=BLOCK_SIZE,
    )
    ids = torch.tensor([7, 11, 13][:n] + [0] * (size - n))
    pos = torch.tensor([s - 1 for s in seq_lens] + [0] * (size - n))
    return ModelInputs(ids, pos, meta, list(range(n)), [str(i) for i in range(n)])


def test_padding_rows_touch_only_the_null_block(model: torch.nn.Module, cache_dir: Path) -> None:
    """3 decodes padded to 4: the cache changes at the 3 new tokens' slots and in the null block only, and the
    real rows equal the paged-attention op's."""
    runner, graph = graph_runner(model, cache_dir, compiler="eager", mode="full_decode_only")
    ref = make_runner(model)
    gen = torch.Generator().manual_seed(0)
    for a, b in zip(runner.kv_caches, ref.kv_caches, strict=True):
        a.copy_(torch.randn(a.shape, generator=gen))
        b.copy_(a)
    before = [c.clone() for c in runner.kv_caches]
    seq_lens, tables = [6, 3, 9], [[4, 9, 0], [2, 0, 0], [5, 6, 8]]
    batch = _decode_step(seq_lens, tables, graph.pad_to(3))
    with torch.inference_mode():
        with set_forward_context(ForwardContext(batch.metadata, runner.kv_caches)):
            got = graph.forward(batch)[:3]
        with set_forward_context(ForwardContext(batch.metadata, ref.kv_caches)):
            want = model(batch.input_ids[:3], batch.positions[:3])
    assert graph.dispatcher.last == ("full", "")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    null = null_block(runner.kv_caches[0])
    for after, old, other in zip(runner.kv_caches, before, ref.kv_caches, strict=True):
        changed = (after != old).any(dim=(0, 1, 4))  # [blocks, block_size]
        touched = {(int(b), int(s)) for b, s in changed.nonzero()}
        assert touched - {(null, 0)} == {(9, 1), (2, 2), (8, 0)}  # position s-1 of each sequence
        real = torch.ones_like(changed)
        real[null] = False
        torch.testing.assert_close(after[:, :, real], other[:, :, real], rtol=0, atol=1e-5)  # K/V as the op wrote


def test_timed_gemv_sizes_get_a_static_full_graph(model: torch.nn.Module, cache_dir: Path) -> None:
    """fp32 weights with a static compile size kept by the kernel choice: batch-1 decode runs a full graph for
    num_tokens=1 whose weight products are GEMV reductions (not BLAS calls), with eager's logits."""
    eager, got = LogitsRecorder(), LogitsRecorder()
    ref = make_runner(model)
    ref.observer = eager
    runner, graph = graph_runner(model, cache_dir, compiler="inductor", mode="full_and_piecewise", compile_sizes=(1,))
    runner.observer = got
    assert set(graph.full.variants) == {None, 1}
    static, dynamic = graph.full.variants[1].piece, graph.full.piece
    assert "extern_kernels.mm" in dynamic.compiled.source_code
    assert "extern_kernels.mm" not in static.compiled.source_code
    prompt = random_prompts([6], seed=5)
    assert generate(runner, prompt, 6) == generate(ref, prompt, 6)
    for g, w in zip(got.logits, eager.logits, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-4)
    graph.counters.expect(full_replays=5, graphs_traced=3)


def test_cuda_table_widths_are_power_of_two_buckets_up_to_the_longest_context() -> None:
    """CUDA captures one decode graph per width bucket, so a short context never gathers max_model_len's blocks."""
    assert width_buckets(512) == [8, 16, 32, 64, 128, 256, 512]
    assert width_buckets(100) == [8, 16, 32, 64, 100]
    assert width_buckets(8) == [8]
    assert width_buckets(3) == [3]
