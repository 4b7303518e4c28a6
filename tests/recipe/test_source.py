"""YAML with positions: syntax errors, duplicate keys and the document's shape, each with line and column."""

from __future__ import annotations

import pytest

from kiln.recipe import RecipeError
from kiln.recipe.source import parse_source


def test_positions_of_keys_values_and_items() -> None:
    doc = parse_source("a: 1\nb: {c: [x, y]}\nd:\n  - z\n", "r.yaml")
    assert doc.keys[("b",)] == (2, 1)
    assert doc.keys[("b", "c")] == (2, 5)
    assert doc.values[("b", "c", 1)] == (2, 12)
    assert doc.values[("d", 0)] == (4, 5)
    assert doc.position(("b", "missing"), key=True) == (2, 1)  # the nearest enclosing key


def test_syntax_error_points_at_the_problem(write, only_error) -> None:
    path = write("""\
        recipe_version: 1
        graph: {capture_sizes: [1, 2}
        """)
    err = only_error(path)
    assert (err.line, err.col) == (2, 29)
    assert err.message == "invalid YAML: expected ',' or ']', but got '}'"
    assert err.format().splitlines() == [
        "recipe.yaml:2:29: error: invalid YAML: expected ',' or ']', but got '}'",
        "graph: {capture_sizes: [1, 2}",
        " " * 28 + "^",
    ]


def test_duplicate_key_is_an_error(write, only_error) -> None:
    path = write("""\
        recipe_version: 1
        model: {name: a}
        model: {name: b}
        """)
    err = only_error(path)
    assert (err.line, err.col) == (3, 1)
    assert err.message.startswith('invalid YAML: found duplicate key "model"')


@pytest.mark.parametrize(
    ("text", "found"), [("", "an empty file"), ("- a\n- b\n", "a CommentedSeq"), ("just text\n", "a str")]
)
def test_top_level_must_be_a_mapping(text: str, found: str) -> None:
    with pytest.raises(RecipeError) as info:
        parse_source(text, "r.yaml")
    assert info.value.diagnostics[0].message.endswith(f"found {found}")


def test_self_referencing_alias_terminates() -> None:
    assert parse_source("a: &x [1, *x]\n", "r.yaml").data == {"a": [1, None]}


def test_alias_bomb_is_bounded() -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [
        f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}]"
        for i in range(1, 9)
    ]
    with pytest.raises(RecipeError) as info:
        parse_source("\n".join(lines) + "\n", "r.yaml")
    assert "recipe too large" in info.value.diagnostics[0].message


def test_non_string_key_is_an_error() -> None:
    with pytest.raises(RecipeError) as info:
        parse_source("recipe_version: 1\n3: x\n", "r.yaml")
    d = info.value.diagnostics[0]
    assert (d.line, d.col, d.message) == (2, 1, "keys must be names, found 3")
