"""Schema validation: unknown keys with "did you mean", strict types, missing keys, and the exported JSON Schema."""

from __future__ import annotations

import json
from pathlib import Path

from kiln.recipe import load_recipe, recipe_json_schema
from kiln.recipe.cli import main

# NOTE: validation reports every error in one pass; these bounds keep the constraint checks quiet, so each test
# sees only its schema errors. Appended last, they leave the line numbers of a test's own lines as they are.
BOUNDS = "input_constraints: {constraints: [num_tokens <= 2048, seq_len <= 2048]}\n"


def test_unknown_key_suggests_the_near_miss(header, write, only_error) -> None:
    path = write(header + "graph: {mode: full, compilr: eager}\n" + BOUNDS)
    err = only_error(path)
    assert (err.line, err.col) == (4, 21)
    assert err.message.startswith("unknown key 'compilr' in graph; did you mean 'compiler'?")
    assert "expected one of: capture_sizes, compile_sizes, compiler, mode, splitting_ops" in err.message


def test_unknown_top_level_section(header, write, only_error) -> None:
    err = only_error(write(header + "memory_plann: {}\n" + BOUNDS))
    assert (err.line, err.col) == (4, 1)
    assert err.message.startswith("unknown key 'memory_plann' at the top level; did you mean 'memory_plan'?")


def test_enum_value_suggests_the_near_miss(header, write, only_error) -> None:
    err = only_error(write(header + "memory_plan:\n  kv_cache: {layout: pagd}\n" + BOUNDS))
    assert (err.line, err.col) == (5, 22)
    assert err.message == (
        "memory_plan.kv_cache.layout: expected 'paged' or 'contiguous', got 'pagd'; did you mean 'paged'?"
    )


def test_types_are_strict(header, write, diagnostics_of) -> None:
    text = 'memory_plan: {kv_cache: {block_size: "16", max_pages: 0}}\ndebug: {debug_mode: yes}\n'
    path = write(header + text + BOUNDS)
    found = {(d.line, d.col, d.message) for d in diagnostics_of(path)}
    assert found == {
        (4, 38, "memory_plan.kv_cache.block_size: expected an integer, got '16'"),
        (4, 55, "memory_plan.kv_cache.max_pages: input should be greater than 0, got 0"),
        (5, 21, "debug.debug_mode: expected true or false, got 'yes'"),
    }


def test_missing_key_points_at_its_section(header, write, only_error) -> None:
    err = only_error(write(header + "fusion_groups:\n  - {ops: [silu]}\n" + BOUNDS))
    assert (err.line, err.col, err.message) == (5, 5, "missing required key 'name' in fusion_groups[0]")


def test_unsupported_version(header, write, diagnostics_of) -> None:
    path = write(header.replace("recipe_version: 1", "recipe_version: 2") + BOUNDS)
    d = diagnostics_of(path)[0]
    assert (d.line, d.col, d.message) == (1, 17, "recipe_version: expected 1, got 2")


def test_json_schema_forbids_unknown_keys() -> None:
    schema = recipe_json_schema()
    assert schema["$schema"].startswith("https://json-schema.org/")
    assert schema["additionalProperties"] is False
    assert set(schema["required"]) == {"recipe_version", "model", "hardware"}
    graph = schema["$defs"]["Graph"]
    assert graph["additionalProperties"] is False
    assert graph["properties"]["compiler"]["enum"] == ["inductor", "eager"]


def test_schema_command_prints_the_schema(capsys) -> None:
    assert main(["schema"]) == 0
    assert json.loads(capsys.readouterr().out) == recipe_json_schema()


def test_checked_in_schema_is_current() -> None:
    path = Path(__file__).resolve().parents[2] / "recipes" / "recipe.schema.json"
    assert json.loads(path.read_text()) == recipe_json_schema(), (
        "run: kiln recipe schema --out recipes/recipe.schema.json"
    )


def test_graph_mode_is_read_and_piecewise_refused(header, write, only_error) -> None:
    recipe = load_recipe(write(header + "graph: {mode: full_decode_only}\n" + BOUNDS))
    assert recipe.graph_mode == "full_decode_only"
    assert load_recipe(write(header + BOUNDS)).graph_mode == "full_and_piecewise"
    path = write(header + "graph: {piecewise: false, mode: piecewise}\n" + BOUNDS)
    err = only_error(path)
    assert (err.line, err.col) == (4, 9)
    assert err.message.startswith(f"graph.piecewise was replaced by graph.mode: run `kiln recipe migrate {path}")
