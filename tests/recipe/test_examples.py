"""The shipped recipes: the default one is valid and clean; each error example documents and shows its error."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kiln.recipe import RecipeError, load_recipe

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
EXAMPLES = sorted((RECIPES / "errors").glob("*.yaml"))
EXPECT = re.compile(r"^# expect: (\d+):(\d+): (error|warning): (.*)$", re.M)


def test_default_recipe_is_valid_without_warnings() -> None:
    recipe = load_recipe(str(RECIPES / "smollm2-135m.yaml"))
    assert recipe.diagnostics == []
    assert [g.name for g in recipe.fusion_groups] == ["mlp_fusion"]
    assert recipe.max_model_len <= recipe.max_pages * recipe.block_size


# The classes of finding, by the validation stage that makes them, and the example that shows each.
ERROR_CLASSES = {
    "yaml": {"yaml_syntax", "duplicate_key"},
    "schema": {"unknown_key", "wrong_type"},
    "expressions": {"assignment", "code_injection", "unknown_symbol", "division_by_zero"},
    "solver": {"conflict", "redundant_constraint"},
    "checkpoint": {"model_symbol", "weights_dtype", "input_shape", "group_size"},
    "graph": {"splitting_op", "fusion_op", "fusion_split", "capture_size"},
    "memory": {"kv_capacity", "memory_budget"},
}


def test_there_is_an_example_per_error_class() -> None:
    """Each class above has its example and each example is one class, and no two examples show the same
    diagnostic (an example copied under another name would show nothing new)."""
    stems = [path.stem for path in EXAMPLES]
    classes = [stem for members in ERROR_CLASSES.values() for stem in members]
    assert sorted(stems) == sorted(classes)
    messages = [EXPECT.search(path.read_text()).group(4) for path in EXAMPLES]
    assert len(set(messages)) == len(messages), messages


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_shows_its_documented_diagnostic(path: Path) -> None:
    text = path.read_text()
    assert text.startswith("# Shows: "), "each example starts with a comment saying what it shows"
    line, col, severity, message = EXPECT.search(text).groups()
    try:
        diagnostics = load_recipe(str(path)).diagnostics
        assert severity == "warning", "an error example must fail to load"
    except RecipeError as exc:
        diagnostics = exc.diagnostics
    found = [(d.line, d.col, d.severity) for d in diagnostics if d.message.startswith(message)]
    assert (int(line), int(col), severity) in found, [d.format() for d in diagnostics]
