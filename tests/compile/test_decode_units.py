"""The full decode graph compiled in layer units (kiln.compile.decode_units): one compile per distinct layer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.compile.decode_units import LayerUnits, layer_index, unit_assignment
from kiln.compile.split import node_module_path
from tests.compile.tiny import generate, graph_runner, make_runner, random_prompts, tiny_model

LAYERS = 4


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model(num_layers=LAYERS)


def test_every_layer_is_one_unit_and_outside_nodes_join_the_first_or_last(model: torch.nn.Module, cache_dir: Path):
    _, graph = graph_runner(model, cache_dir, compiler="eager", mode="full_decode_only")
    gm = graph.full.piece.graph
    units = unit_assignment(gm)
    layers = {node: layer_index(node) for node in units}
    assert set(units.values()) == set(range(LAYERS))
    for node, unit in units.items():
        if layers[node] is not None:
            assert unit == layers[node]
    ops = [n for n in gm.graph.nodes if n in units]
    assert [units[n] for n in ops] == sorted(units[n] for n in ops)  # units never go back along the graph
    paths = {node: node_module_path(node) for node in ops}
    embedding = [n for n in ops if paths[n].startswith("model.embed_tokens")]
    final_norm = [n for n in ops if paths[n].startswith("model.norm")]
    assert embedding and all(units[n] == 0 for n in embedding)
    assert final_norm and all(units[n] == LAYERS - 1 for n in final_norm)
    split = LayerUnits(gm)
    assert len(split.units) == LAYERS and split.distinct == 3  # first, middle (x2, identical), last


def test_units_compile_once_per_structure_give_the_whole_graph_and_load_from_the_cache(
    model: torch.nn.Module, cache_dir: Path
) -> None:
    """Inductor: 3 pieces and 3 distinct layer units compiled (4 units run); the tokens are eager's; a second
    engine over the same cache compiles nothing and loads all 6."""
    prompts = random_prompts([4, 9], seed=5)
    want = generate(make_runner(model), prompts, 6)
    runner, graph = graph_runner(model, cache_dir, compiler="inductor", mode="full_and_piecewise")
    graph.counters.expect(pieces_compiled=3 + 3, cache_misses=6, cache_hits=0)
    assert generate(runner, prompts, 6) == want
    assert graph.counters.full_replays > 0
    source = graph.full.piece.compiled.source_code
    assert source is not None and source.count("# layer unit ") == 3
    again, second = graph_runner(model, cache_dir, compiler="inductor", mode="full_and_piecewise")
    second.counters.expect(pieces_compiled=0, cache_hits=6, cache_rejected=0)
    assert generate(again, prompts, 6) == want
    # the probe run that checked the cached units held a whole set of KV caches: nothing keeps it past the compile
    units = second.full.variants[None].units
    assert units is not None and units._probes is None
