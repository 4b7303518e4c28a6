"""Inductor on a tiny model: the on-disk compile cache (warm start, corrupt and stale entries) and the artifacts."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from kiln.compile.cache import MANIFEST
from tests.compile.tiny import generate, graph_runner, make_runner, random_prompts, tiny_model

PROMPTS = random_prompts([4, 7])


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model(num_layers=3, seed=3)


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kiln-cache")


def test_cold_then_warm_start(model: torch.nn.Module, shared_cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    expected = generate(make_runner(model), PROMPTS, 4)
    runner, graph = graph_runner(model, shared_cache, compiler="inductor")
    graph.counters.expect(pieces_seen=4, pieces_compiled=3, cache_misses=3, cache_hits=0, pieces_captured=12)
    assert generate(runner, PROMPTS, 4) == expected
    with caplog.at_level(logging.INFO, logger="kiln"):
        runner, graph = graph_runner(model, shared_cache, compiler="inductor")
    graph.counters.expect(pieces_seen=4, pieces_compiled=0, cache_hits=3, cache_misses=0, cache_rejected=0)
    assert caplog.text.count("from the compile cache") == 3
    assert generate(runner, PROMPTS, 4) == expected


def test_warm_start_with_column_major_weights(tmp_path: Path) -> None:
    """kiln stores CPU layer weights column-major; a cached piece must be checked with those strides, not rejected."""
    from kiln.kernels.layout import COLUMN_MAJOR, set_layer_weight_layout
    from tests.compile.tiny import tiny_model

    model = tiny_model(num_layers=3)
    assert set_layer_weight_layout(model, COLUMN_MAJOR)
    expected = generate(make_runner(model), PROMPTS, 4)
    graph_runner(model, tmp_path, compiler="inductor")
    runner, graph = graph_runner(model, tmp_path, compiler="inductor")
    graph.counters.expect(pieces_compiled=0, cache_hits=3, cache_rejected=0)
    assert generate(runner, PROMPTS, 4) == expected


def test_corrupt_and_stale_entries_are_rebuilt(model: torch.nn.Module, shared_cache: Path) -> None:
    graph_runner(model, shared_cache, compiler="inductor")  # make sure the entries exist
    entries = sorted((shared_cache / "compile").iterdir())
    assert len(entries) == 3
    artifact = entries[0] / "artifact.bin"
    artifact.write_bytes(artifact.read_bytes()[:-64] + b"\0" * 64)  # corrupt: checksum mismatch
    manifest = json.loads((entries[1] / MANIFEST).read_text())
    manifest["torch_version"] = "1.0.0"  # stale: built by another torch
    (entries[1] / MANIFEST).write_text(json.dumps(manifest))
    runner, graph = graph_runner(model, shared_cache, compiler="inductor")
    graph.counters.expect(cache_rejected=2, pieces_compiled=2, cache_hits=1)
    assert generate(runner, PROMPTS, 4) == generate(make_runner(model), PROMPTS, 4)
    _, graph = graph_runner(model, shared_cache, compiler="inductor")
    graph.counters.expect(cache_rejected=0, pieces_compiled=0, cache_hits=3)


def test_artifacts_are_written_and_parse(model: torch.nn.Module, shared_cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "dump"
    graph_runner(model, shared_cache, compiler="inductor", dump_dir=str(out), piece_modes="3:eager")
    for k in range(4):
        ir = (out / "pieces" / f"piece_{k}.txt").read_text()
        assert ir.startswith(f"# piece {k}:")
    assert "model.layers.0.mlp.down_proj" in (out / "pieces" / "piece_1.txt").read_text()
    dot = (out / "graph.dot").read_text()
    assert dot.startswith("digraph kiln {") and dot.rstrip().endswith("}")
    assert "piece 3 (eager)" in dot and "cluster_fusion_" in dot and "kiln.attention" in dot
    profile = json.loads((out / "kernel_profile.json").read_text())
    assert [p["piece"] for p in profile["pieces"]] == [0, 1, 2, 3]
    first = profile["pieces"][0]
    assert first["op_count"] > 0 and first["kernel_count"] > 0 and first["static_buffer_bytes"] > 0
    assert set(first["latency_us"]) == {"1", "2", "4"}
    assert profile["pieces"][3]["latency_us"] == {}  # eager piece: not captured
    fusion = json.loads((out / "fusion.json").read_text())["groups"]
    assert [g["name"] for g in fusion] == ["mlp_fusion"]
    assert fusion[0]["realised"] and fusion[0]["checked"] and fusion[0]["broken_by"] == ""
    assert fusion[0]["scope"] == "model.layers.0.mlp" and fusion[0]["piece"] == 1
    assert fusion[0]["kernels"] == ["extern_kernels.mm", "cpp_fused_mul_silu_split_1"]  # gate_up_proj, then SiLU * up
    lint = (out / "lint.txt").read_text()
    assert "graph breaks: 0" in lint and "no-op" in lint
    # graph mode piecewise (tests/compile/tiny.py): no full decode graph to dump
    assert not (out / "full_decode.txt").exists() and profile["full_decode_graph"] is None
    assert json.loads((out / "fusion.json").read_text())["full_decode_graph"] is None


def test_the_full_decode_graph_is_dumped(model: torch.nn.Module, shared_cache: Path, tmp_path: Path) -> None:
    """Decode-only steps run the full decode graph (graph mode full_and_piecewise): its IR, its layer units' code,
    its kernel profile and its fusion reports are written beside the pieces'."""
    out = tmp_path / "dump"
    graph_runner(model, shared_cache, compiler="inductor", dump_dir=str(out), mode="full_and_piecewise")
    ir = (out / "full_decode.txt").read_text()
    assert ir.startswith("# full decode graph:") and "model.layers.2.mlp.down_proj" in ir
    code = (out / "full_decode.generated.py").read_text()
    assert code.count("# layer unit ") == 3 and code.count("def call(") == 3  # first, middle and last layer
    profile = json.loads((out / "kernel_profile.json").read_text())["full_decode_graph"]
    assert profile["sizes"] == [1, 2, 4] and profile["layer_units"] == 3 and profile["op_count"] > 0
    units = profile["units"]
    assert [u["layer_units"] for u in units] == [[0], [1], [2]]
    assert all(u["kernel_count"] > 0 and u["compiled_from"] in ("compiled", "cache") for u in units)
    assert profile["kernel_count"] == sum(u["kernel_count"] for u in units)
    assert any("silu" in k for k in units[1]["kernels"]) and "extern_kernels.mm" in units[1]["kernels"]
    (fusion,) = json.loads((out / "fusion.json").read_text())["full_decode_graph"]
    assert fusion["name"] == "mlp_fusion" and fusion["realised"] and fusion["code"].startswith("full decode graph")
    assert fusion["kernels"] == ["extern_kernels.mm", "cpp_fused_mul_silu_split_3"]
