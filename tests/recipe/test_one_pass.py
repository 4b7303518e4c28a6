"""Validation reports every error in one pass (schema, constraints, checkpoint), sorted by line; unknown keys of
the community shape get their kiln spelling; a file of comments says so."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.recipe import RecipeError, load_recipe, load_recipe_text
from kiln.recipe.cli import main
from kiln.recipe.schema_check import validate_schema
from kiln.recipe.source import parse_source

MISTAKES = Path(__file__).resolve().parents[2] / "recipes" / "community" / "mistakes.yaml"
BOUNDS = "input_constraints: {constraints: [num_tokens <= 2048, seq_len <= 2048]}\n"
MIGRATE = "(kiln recipe migrate converts community recipes)"
TENSOR_WITH_CONSTRAINTS = (
    "input_constraints:\n  hidden_states: {shape: [num_tokens, hidden_size], dtype: float32, constraints: []}\n"
)


def test_the_community_example_with_mistakes_reports_them_all_in_line_order(capsys) -> None:
    with pytest.raises(RecipeError) as info:
        load_recipe(str(MISTAKES))
    found = [(d.line, d.col, d.message) for d in info.value.diagnostics if d.severity == "error"]
    assert [(line, col) for line, col, _ in found] == [(1, 1), (5, 1), (9, 7), (11, 18), (12, 25), (13, 1)]
    messages = [message for _, _, message in found]
    assert messages[0] == "missing required key 'model' at the top level"
    assert messages[1] == f"unknown key 'model_name' at the top level; kiln spells it model.name {MIGRATE}"
    assert messages[2] == "seq_len <= 2048 (line 9) conflicts with seq_len >= 4096 (line 10)"  # the solver ran
    assert messages[3].startswith("weights.dtype: float32 claims the checkpoint holds float32 weights")  # the header
    assert messages[4] == f"unknown key 'gpu_arch' in hardware; kiln spells it hardware.arch {MIGRATE}"
    assert messages[5] == f"unknown key 'debug_mode' at the top level; kiln spells it debug.debug_mode {MIGRATE}"
    assert main(["validate", str(MISTAKES)]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == "6 errors, 0 warnings"


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        ("model_name: m\n", 4, f"unknown key 'model_name' at the top level; kiln spells it model.name {MIGRATE}"),
        ("version: '1.0'\n", 4, f"unknown key 'version' at the top level; kiln spells it recipe_version {MIGRATE}"),
        (
            "hardware_preference: {gpu_arch: sm_80}\n",
            4,
            f"unknown key 'hardware_preference' at the top level; kiln keeps these settings in hardware {MIGRATE}",
        ),
        (
            TENSOR_WITH_CONSTRAINTS,
            5,
            "unknown key 'constraints' in input_constraints.hidden_states; kiln spells it "
            f"input_constraints.constraints {MIGRATE}",
        ),
    ],
)
def test_community_keys_get_their_kiln_spelling(header, write, diagnostics_of, text, line, message) -> None:
    errors = [d for d in diagnostics_of(write(header + text)) if d.severity == "error"]
    assert (line, message) in [(d.line, d.message) for d in errors], [d.format() for d in errors]


def test_a_community_key_in_a_kiln_section(header, write, only_error) -> None:
    err = only_error(write(header + BOUNDS + "hardware: {device: cpu, power_limit_watts: 300}\n"))
    assert (err.line, err.col) == (5, 25)
    assert err.message == (
        f"unknown key 'power_limit_watts' in hardware; kiln has no such setting: kiln does not manage device power "
        f"{MIGRATE}"
    )


def test_other_unknown_keys_keep_did_you_mean(header, write, only_error) -> None:
    err = only_error(write(header + BOUNDS + "hardware: {device: cpu, archh: sm_80}\n"))
    assert err.message == (
        "unknown key 'archh' in hardware; did you mean 'arch'? (expected one of: arch, device, memory_budget_gb)"
    )


def test_a_schema_error_alone_still_fails_and_the_rest_is_checked(header, write, diagnostics_of) -> None:
    """The partial spec (without the bad key) is checked but never returned as a Recipe."""
    path = write(header + "graph: {capture_sizes: [8, '16']}\n" + "input_constraints: {constraints: [seq_len <= 64]}\n")
    found = [(d.line, d.severity, d.message) for d in diagnostics_of(path)]
    assert (4, "error", "graph.capture_sizes[1]: expected an integer, got '16'") in found
    assert any(severity == "warning" and "num_tokens has no provable upper bound" in m for _, severity, m in found)


def test_validate_schema_returns_a_partial_spec_and_the_errors() -> None:
    doc = parse_source("recipe_version: 1\nmodel: {path: default}\nhardware: {device: cpu, bogus: 1}\n", "r.yaml")
    spec, diagnostics = validate_schema(doc)
    assert spec is not None and spec.model.path == "default" and spec.hardware.device == "cpu"
    assert [(d.line, d.message) for d in diagnostics] == [
        (2, "missing required key 'name' in model"),
        (3, "unknown key 'bogus' in hardware (expected one of: arch, device, memory_budget_gb)"),
    ]
    clean = parse_source("recipe_version: 1\nmodel: {name: m}\nhardware: {device: cpu}\n", "r.yaml")
    assert validate_schema(clean)[1] == []


def test_a_missing_model_does_not_stop_the_constraint_checks(write, diagnostics_of) -> None:
    path = write(
        "recipe_version: 1\nhardware: {device: cpu}\nweights: {dtype: float32, source_quantization: q4_1}\n"
        "input_constraints: {constraints: [seq_len <= 8, seq_len > 9]}\n"
    )
    found = [(d.line, d.message) for d in diagnostics_of(path) if d.severity == "error"]
    assert found[0] == (1, "missing required key 'model' at the top level")
    assert found[1][0] == 4 and "conflicts with" in found[1][1] and "seq_len <= 8" in found[1][1]
    assert len(found) == 2, found  # the stand-in model name claims nothing about the checkpoint


def test_a_file_of_comments_says_so() -> None:
    with pytest.raises(RecipeError) as info:
        load_recipe_text("# a recipe, one day\n\n   # indented\n", "r.yaml")
    (d,) = info.value.diagnostics
    assert (d.line, d.col) == (1, 1)
    assert d.message == "the recipe has only comments; expected a mapping with recipe_version, model, ..."
    with pytest.raises(RecipeError) as info:
        load_recipe_text("\n  \n", "r.yaml")
    assert info.value.diagnostics[0].message.endswith("found an empty file")
