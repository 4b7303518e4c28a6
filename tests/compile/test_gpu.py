"""Graph mode on CUDA: real CUDA graphs in one shared pool, parity with eager (skipped without a GPU)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kiln.compile.capture import CudaGraphCapture
from kiln.config import SpeculativeConfig
from kiln.engine.running.model_runner import ModelRunner
from kiln.engine.speculation.speculation import Speculator
from kiln.model.forward_context import ModelInputs
from tests.compile.tiny import generate, graph_runner, make_runner, random_prompts, tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
PROMPTS = random_prompts([5, 3, 9])


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_cuda_graph_pieces_match_eager(compiler: str, cache_dir: Path) -> None:
    model = tiny_model(num_layers=3, device="cuda")
    expected = generate(make_runner(model), PROMPTS, 5)
    runner, graph = graph_runner(model, cache_dir, compiler=compiler)
    graph.counters.expect(pieces_seen=4, pieces_compiled=3, pieces_captured=12)
    assert all(isinstance(c, CudaGraphCapture) for p in graph.pieces for c in p.captures.values())
    assert generate(runner, PROMPTS, 5) == expected
    graph.counters.expect(dynamic_fallbacks=1, replays=4, padding_tokens=4)


def test_full_graph_on_cuda_runs_uncaptured(cache_dir: Path) -> None:
    """Mode full: mixed steps run the whole forward (the attention op inside) compiled, uncaptured."""
    model = tiny_model(num_layers=2, device="cuda")
    expected = generate(make_runner(model), PROMPTS, 4)
    runner, graph = graph_runner(model, cache_dir, compiler="eager", mode="full")
    graph.counters.expect(pieces_seen=1, pieces_captured=0, full_graphs_captured=3 * len(graph.full.buffers.widths))
    assert generate(runner, PROMPTS, 4) == expected


def forbid_syncs(runner: ModelRunner, applies: Callable[[ModelInputs], bool]) -> None:
    """Make a host sync an error inside the forward of every step `applies` to (the sampler may sync, taking the
    logits to the host; a decode-only forward must not)."""
    forward = runner.forward

    def strict_forward(inputs: ModelInputs) -> torch.Tensor:
        if not applies(inputs):
            return forward(inputs)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return forward(inputs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    runner.forward = strict_forward


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_full_decode_graph_is_a_cuda_graph_and_never_syncs(compiler: str, cache_dir: Path) -> None:
    """full_and_piecewise on CUDA: one CUDA graph per capture size replays every decode-only step, no host sync."""
    model = tiny_model(num_layers=3, device="cuda")
    expected = generate(make_runner(model), PROMPTS, 5)
    runner, graph = graph_runner(model, cache_dir, compiler=compiler, mode="full_and_piecewise")
    widths = graph.full.buffers.widths  # one CUDA graph per size and table-width bucket
    graph.counters.expect(full_graphs_captured=3 * len(widths), pieces_captured=12)
    assert set(graph.full.piece.captures) == {(n, w) for n in (1, 2, 4) for w in widths}
    assert all(isinstance(c, CudaGraphCapture) for c in graph.full.piece.captures.values())
    assert graph.full.buffers.staging.is_pinned()
    forbid_syncs(runner, lambda inputs: inputs.metadata.num_decodes == inputs.metadata.num_seqs)
    assert generate(runner, PROMPTS, 5) == expected
    graph.counters.expect(full_replays=4, full_fallbacks_mixed=1, dynamic_fallbacks=1)


def test_verification_steps_replay_the_full_decode_graph_without_a_sync(cache_dir: Path) -> None:
    """n-gram speculation on CUDA: decode-only verification steps (each draft token a decode row) replay the full
    decode graph's CUDA graphs without a host sync, and the greedy tokens are those without speculation."""
    model = tiny_model(num_layers=3, device="cuda")
    prompts = [p * 3 for p in PROMPTS]  # repeated, so the lookups find earlier occurrences
    expected = generate(make_runner(model), prompts, 12)
    runner, graph = graph_runner(
        model, cache_dir, compiler="eager", mode="full_and_piecewise", capture_sizes=(1, 2, 4, 8)
    )
    forbid_syncs(runner, lambda i: i.num_draft_tokens > 0 and i.metadata.num_decodes == i.metadata.num_seqs)
    speculator = Speculator(SpeculativeConfig("ngram", 3, prompt_lookup_min=1, policy="always"), max_model_len=256)
    assert generate(runner, prompts, 12, speculator=speculator) == expected
    assert speculator.stats.num_drafts > 0 and graph.counters.full_verify_replays > 0
