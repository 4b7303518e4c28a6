"""Pipeline placement: `parallel` and `device_affinity` validated line by line, read by the engine's overlay, and
the load report of what each device holds (the default model: 30 layers, tied embedding, 3 KV heads)."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from kiln.config import EngineConfig
from kiln.engine.setup.recipe_config import overlay_recipe
from kiln.recipe import load_recipe
from kiln.recipe.checkpoint import read_header
from kiln.recipe.cli import main
from kiln.recipe.migrate import migrate_text
from kiln.recipe.placement import BALANCE_LIMIT, even_stage_layers, recipe_placement
from kiln.recipe.source import parse_source

BOUNDS = "input_constraints: {constraints: [num_tokens <= 2048, seq_len <= 2048]}\n"
EXAMPLE = Path(__file__).resolve().parents[2] / "recipes" / "smollm2-135m-pp2.yaml"


def layers(first: int, end: int) -> list[str]:
    return [f"decoder_layer_{i}" for i in range(first, end)]


def affinity(*stages: tuple[int, list[str]]) -> str:
    """device_affinity with one entry a line: the key on the first line, entry i on the (i + 2)th."""
    entries = "".join(f"  - {{device_id: {d}, kernel_groups: [{', '.join(groups)}]}}\n" for d, groups in stages)
    return "device_affinity:\n" + entries


HALVES = affinity((0, layers(0, 15)), (1, layers(15, 30)))


def test_a_valid_placement_gives_the_stages_in_device_order(header, write) -> None:
    recipe = load_recipe(write(header + affinity((1, layers(15, 30)), (0, layers(0, 15))) + BOUNDS))
    assert recipe.diagnostics == []
    assert (recipe.tensor_parallel, recipe.pipeline_parallel) == (1, 2)  # pipeline = the number of entries
    assert recipe.stage_layers == (tuple(range(15)), tuple(range(15, 30)))
    recipe = load_recipe(write(header + "parallel: {tensor: 3}\n" + HALVES + BOUNDS))
    assert (recipe.tensor_parallel, recipe.pipeline_parallel) == (3, 2)
    plain = load_recipe(write(header + BOUNDS))
    assert (plain.tensor_parallel, plain.pipeline_parallel, plain.stage_layers) == (1, 1, None)
    assert load_recipe(write(header + "parallel: {pipeline: 4}\n" + BOUNDS)).pipeline_parallel == 4


def test_an_unknown_kernel_group_is_refused_with_the_expected_form(header, write, only_error) -> None:
    err = only_error(write(header + affinity((0, ["attn_0", *layers(0, 15)]), (1, layers(15, 30))) + BOUNDS))
    assert err.line == 5 and "unknown kernel group 'attn_0'" in err.message
    assert "expected decoder_layer_<i> with i in [0, 30)" in err.message


def test_a_layer_beyond_the_model_is_refused(header, write, only_error) -> None:
    text = header + affinity((0, layers(0, 15)), (1, layers(15, 31))) + BOUNDS
    err = only_error(write(text))
    assert err.line == 6 and "kernel group 'decoder_layer_30' is out of range" in err.message
    assert "the model has 30 decoder layers" in err.message


def test_a_layer_placed_twice_names_both_lines(header, write, only_error) -> None:
    err = only_error(write(header + affinity((0, layers(0, 15)), (1, ["decoder_layer_3", *layers(15, 30)])) + BOUNDS))
    assert err.line == 6 and err.message.startswith("decoder_layer_3 is placed twice (also on line 5)")


def test_a_missing_layer_is_named(header, write, only_error) -> None:
    err = only_error(write(header + affinity((0, layers(0, 15)), (1, layers(15, 29))) + BOUNDS))
    assert err.line == 4 and err.message.startswith("decoder_layer_29 is placed on no device")


def test_a_stage_must_hold_consecutive_layers(header, write, diagnostics_of) -> None:
    first = [*layers(0, 14), "decoder_layer_15"]
    second = ["decoder_layer_14", *layers(16, 30)]
    found = [(d.line, d.message) for d in diagnostics_of(write(header + affinity((0, first), (1, second)) + BOUNDS))]
    assert [line for line, _ in found] == [5, 6]
    assert "device 0's layers are not consecutive: decoder_layer_15 follows decoder_layer_13" in found[0][1]
    assert "device 1's layers are not consecutive: decoder_layer_16 follows decoder_layer_14" in found[1][1]


def test_stages_follow_the_layers_in_device_order(header, write, only_error) -> None:
    err = only_error(write(header + affinity((1, layers(0, 15)), (0, layers(15, 30))) + BOUNDS))
    assert err.line == 5
    assert err.message.startswith("device 1 holds decoder_layer_0..decoder_layer_14 but device 0 holds")


def test_device_ids_lie_in_the_pipeline(header, write, only_error) -> None:
    text = header + "parallel: {pipeline: 2}\n" + affinity((0, layers(0, 15)), (2, layers(15, 30))) + BOUNDS
    err = only_error(write(text))
    assert err.line == 7 and "device_id 2 is outside [0, 2): parallel.pipeline is 2 (line 4)" in err.message
    err = only_error(write(header + affinity((0, layers(0, 15)), (5, layers(15, 30))) + BOUNDS))
    assert err.line == 6 and "device_id 5 is outside [0, 2): pipeline = the 2 device_affinity entries" in err.message
    err = only_error(write(header + "parallel: {pipeline: 3}\n" + HALVES + BOUNDS))
    assert err.line == 5 and "no entry for device_id 2" in err.message


def test_a_device_id_appears_once(header, write, only_error) -> None:
    err = only_error(write(header + affinity((0, layers(0, 15)), (0, layers(15, 30))) + BOUNDS))
    assert err.line == 6 and err.message == "device_id 0 is listed twice (also on line 5)"


def test_more_stages_than_layers_is_refused(header, write, only_error) -> None:
    err = only_error(write(header + "parallel: {pipeline: 31}\n" + BOUNDS))
    assert err.line == 4 and "parallel.pipeline 31 is more stages than the model's 30 decoder layers" in err.message


def test_the_hash_follows_the_placement_as_it_runs(header, write) -> None:
    plain = load_recipe(write(header + BOUNDS)).hash
    assert load_recipe(write(header + "parallel: {tensor: 1, pipeline: 1}\n" + BOUNDS)).hash == plain
    derived = load_recipe(write(header + HALVES + BOUNDS)).hash
    assert load_recipe(write(header + "parallel: {pipeline: 2}\n" + HALVES + BOUNDS)).hash == derived
    other = load_recipe(write(header + affinity((0, layers(0, 11)), (1, layers(11, 30))) + BOUNDS)).hash
    assert len({plain, derived, other}) == 3


def test_the_overlay_sets_the_parallel_config(header, write, caplog) -> None:
    recipe = load_recipe(write(header + "parallel: {tensor: 2}\n" + HALVES + BOUNDS))
    with caplog.at_level(logging.INFO, logger="kiln"):
        config = overlay_recipe(EngineConfig(), recipe)
    assert (config.parallel.tensor, config.parallel.pipeline, config.parallel.world_size) == (2, 2, 4)
    assert config.parallel.stage_layers == (tuple(range(15)), tuple(range(15, 30)))
    assert "sets parallel.pipeline=2 (was 1)" in caplog.text and "sets parallel.tensor=2 (was 1)" in caplog.text


def test_the_load_report_adds_up_to_the_checkpoint(header, write) -> None:
    placement = recipe_placement(load_recipe(write(header + HALVES + BOUNDS)))
    shapes = read_header("default").tensor_shapes
    total = sum(4 * math.prod(shape) for shape in shapes.values())  # float32 weights
    assert sum(s.weight_bytes for s in placement.stages) == placement.total_weight_bytes == total
    assert [s.layers for s in placement.stages] == [tuple(range(15)), tuple(range(15, 30))]
    embedding = 4 * math.prod(shapes["token_embd.weight"])
    first, last = placement.stages
    assert first.weight_bytes - last.weight_bytes == embedding - 4 * math.prod(shapes["output_norm.weight"])
    assert (first.head_copy_bytes, last.head_copy_bytes) == (0, embedding)  # the tied head, held by the last stage
    config = read_header("default").config
    kv_dtype = torch.float32  # kv_cache.dtype auto: the weights' dtype (kiln.config.AUTO_KV_CACHE_DTYPE)
    assert first.kv_bytes == last.kv_bytes == config.kv_bytes_per_token(kv_dtype) // 2 * 1024 * 16
    assert placement.warning is None  # 15/15 holds the same bytes: the head copy weighs what the embedding does


def test_an_unbalanced_placement_warns_with_the_numbers(header, write, capsys) -> None:
    path = write(header + affinity((0, layers(0, 5)), (1, layers(5, 30))) + BOUNDS)
    placement = recipe_placement(load_recipe(path))
    assert placement.imbalance > BALANCE_LIMIT
    assert placement.warning.startswith("unbalanced placement: device 1 holds ")
    assert main(["validate", path]) == 0
    out = capsys.readouterr().out
    assert "[INFO]   device 0: decoder_layer_0..4 (5 layers) + embedding: weights " in out
    assert "[WARNING] unbalanced placement: device 1 holds" in out and f"above {BALANCE_LIMIT}x" in out


def test_tensor_ranks_share_a_stage(header, write, capsys) -> None:
    """3 KV heads: over 3 ranks one each; over 2 ranks the first holds two (the per-device figure is the larger)."""
    for tensor, heads in ((3, 1), (2, 2)):
        path = write(header + f"parallel: {{tensor: {tensor}}}\n" + HALVES + BOUNDS)
        stage = recipe_placement(load_recipe(path)).stages[0]
        assert stage.kv_bytes_per_device == stage.kv_bytes * heads // 3
        assert stage.weight_bytes_per_device == -(-stage.held_bytes // tensor)
    assert main(["validate", path]) == 0
    assert "stage 0 (2 devices): decoder_layer_0..14 (15 layers) + embedding" in capsys.readouterr().out


def test_one_device_reports_in_one_line(header, write, capsys) -> None:
    assert main(["validate", write(header + BOUNDS)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "Placement" in line]
    assert len(lines) == 1 and lines[0].startswith("[INFO] Placement: one device holds all 30 decoder layers")


def test_an_even_split_gives_the_first_stages_the_extra_layers() -> None:
    assert even_stage_layers(5, 2) == ((0, 1, 2), (3, 4))
    assert even_stage_layers(30, 3) == tuple(tuple(range(s * 10, s * 10 + 10)) for s in range(3))


def test_the_two_stage_example_validates() -> None:
    recipe = load_recipe(str(EXAMPLE))
    assert recipe.diagnostics == []
    assert [len(s) for s in recipe.stage_layers] == [15, 15] and recipe.pipeline_parallel == 2


def test_migrate_keeps_a_stage_list_and_moves_device_settings() -> None:
    stages = "model_name: m\ndevice_affinity:\n  - {device_id: 0, kernel_groups: [decoder_layer_0]}\n"
    data = parse_source(migrate_text(stages, "s.yaml").text, "m.yaml").data
    assert data["device_affinity"] == [{"device_id": 0, "kernel_groups": ["decoder_layer_0"]}]
    settings = "model_name: m\ndevice_affinity: {device: cpu, device_ids: [0, 1]}\n"
    migration = migrate_text(settings, "s.yaml")
    assert "device_affinity" not in parse_source(migration.text, "m.yaml").data
    (note,) = migration.notes
    assert note.message.startswith("device_ids not carried: kiln numbers the devices it runs on from 0")


def test_a_settings_mapping_in_a_kiln_recipe_points_at_migrate(header, write, only_error) -> None:
    err = only_error(write(header + "device_affinity: {device: cpu}\n" + BOUNDS))
    assert err.line == 4 and err.message.startswith("device_affinity: expected a list")
    assert "kiln keeps them in hardware" in err.message
