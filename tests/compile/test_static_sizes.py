"""Static compile sizes (inductor, tiny model): one/two-row pieces and the logits head become GEMV reductions,
counted, cached, and equal to eager."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.compile.passes import GEMV_MAX_ROWS
from kiln.errors import ConfigError
from kiln.kernels.layout import COLUMN_MAJOR, set_layer_weight_layout
from tests.compile.tiny import generate, graph_runner, make_runner, random_prompts, tiny_model

PROMPTS = random_prompts([5, 3])


def _generate(runner: object) -> list[list[int]]:
    """Decode steps of 2 rows (both prompts) and of 1 row (one prompt): the static sizes' captures."""
    return generate(runner, PROMPTS, 6) + generate(runner, PROMPTS[1:], 4)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    model = tiny_model(num_layers=3, seed=5)
    assert set_layer_weight_layout(model, COLUMN_MAJOR)  # as kiln loads CPU fp32 models for eager
    return model


def _extern_mm_calls(source: str | None) -> int:
    assert source is not None
    return source.count("extern_kernels.mm(") + source.count("extern_kernels.addmm(")


def test_static_sizes_compile_cache_and_match_eager(model: torch.nn.Module, tmp_path: Path) -> None:
    expected = _generate(make_runner(model))
    runner, graph = graph_runner(model, tmp_path, compiler="inductor", compile_sizes=(1, 2, 4))
    # 3 distinct pieces x 3 sizes, plus the one-row logits head
    graph.counters.expect(pieces_compiled=3, static_compiles=3 * 3 + 1, static_cache_hits=0, pieces_captured=12)
    layer = model.model.layers[0]
    assert layer.mlp.gate_up_proj.weight.is_contiguous()  # graph mode stores decoder weights row-major
    middle = graph.pieces[1]
    assert _extern_mm_calls(middle.compiled.source_code) > 0  # the dynamic piece keeps BLAS
    for size in (1, 2):
        assert size <= GEMV_MAX_ROWS
        assert _extern_mm_calls(middle.static_compiled[size].source_code) == 0  # reductions instead
    assert _extern_mm_calls(middle.static_compiled[4].source_code) > 0  # 4 rows: BLAS is faster
    replays = graph.counters.replays
    assert _generate(runner) == expected
    assert graph.counters.replays > replays

    runner, graph = graph_runner(model, tmp_path, compiler="inductor", compile_sizes=(1, 2, 4))
    graph.counters.expect(pieces_compiled=0, cache_hits=3, static_compiles=0, static_cache_hits=10, cache_rejected=0)
    assert _generate(runner) == expected


def test_artifacts_show_the_static_kernels(model: torch.nn.Module, tmp_path: Path) -> None:
    out = tmp_path / "dump"
    graph_runner(model, tmp_path, compiler="inductor", compile_sizes=(1, 4), dump_dir=str(out))
    profile = json.loads((out / "kernel_profile.json").read_text())
    assert profile["compile_sizes"] == [1, 4]
    middle = profile["pieces"][1]
    assert "extern_kernels.mm" in middle["kernels"]
    assert "extern_kernels.mm" not in middle["static_kernels"]["1"]
    assert "extern_kernels.mm" in middle["static_kernels"]["4"]
    assert "def call(" in (out / "pieces" / "piece_1.n1.generated.py").read_text()


def test_logits_head_matches_the_model(model: torch.nn.Module, tmp_path: Path) -> None:
    _, graph = graph_runner(model, tmp_path, compiler="inductor", compile_sizes=(1,))
    hidden = torch.randn(1, model.config.hidden_size)
    with torch.inference_mode():
        torch.testing.assert_close(graph.compute_logits(hidden, [0]), model.compute_logits(hidden), rtol=0, atol=1e-5)
        two = torch.randn(2, model.config.hidden_size)  # more rows: the model's own head
        torch.testing.assert_close(graph.compute_logits(two, [0, 1]), model.compute_logits(two), rtol=0, atol=0)


def test_automatic_sizes_need_a_compiler_with_static_variants(model: torch.nn.Module, tmp_path: Path) -> None:
    # with inductor the automatic sizes are timed on the machine (tests/compile/test_kernel_choice.py)
    _, graph = graph_runner(model, tmp_path, compiler="eager", compile_sizes=None)
    assert graph.compile_sizes == () and "static_sizes" not in graph.kernel_choices


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"compiler": "inductor", "compile_sizes": (8,)}, "compile sizes [8] are not capture sizes [1, 2, 4]"),
        ({"compiler": "eager", "compile_sizes": (1,)}, "compile sizes [1] need the inductor compiler"),
    ],
)
def test_bad_compile_sizes(tmp_path: Path, overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        graph_runner(tiny_model(), tmp_path, **overrides)
