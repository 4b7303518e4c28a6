"""Graph mode on CUDA: real CUDA graphs in one shared pool, parity with eager (skipped without a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.compile.capture import CudaGraphCapture
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
    model = tiny_model(num_layers=2, device="cuda")
    expected = generate(make_runner(model), PROMPTS, 4)
    runner, graph = graph_runner(model, cache_dir, compiler="eager", full_graph=True)
    graph.counters.expect(pieces_seen=1, pieces_captured=0)
    assert generate(runner, PROMPTS, 4) == expected
