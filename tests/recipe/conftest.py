"""Helpers for recipe tests: write a small recipe as `recipe.yaml` in a temp dir and collect its diagnostics."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from kiln.recipe import Diagnostic, RecipeError, load_recipe

# Three lines every small test recipe starts with; a test's own lines are numbered from 4.
HEADER = """\
recipe_version: 1
model: {name: smollm2-135m-instruct, path: default}
weights: {dtype: float32, source_quantization: q4_1}
"""


@pytest.fixture
def header() -> str:
    """The first three lines of a small test recipe (the default model, its Q4_1 weights)."""
    return HEADER


# Appended to a test recipe that names no hardware (after its last line, so line numbers do not move).
DEVICE = "hardware: {device: cpu}\n"


@pytest.fixture
def write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], str]:
    """Write dedented recipe text to ./recipe.yaml (cwd = a temp dir) and return "recipe.yaml". A recipe (it has
    `recipe_version`) that does not mention `hardware` gets DEVICE as its last line: the device is required."""
    monkeypatch.chdir(tmp_path)

    def _write(text: str) -> str:
        text = textwrap.dedent(text)
        if "recipe_version" in text and "hardware" not in text:
            text = text + ("" if text.endswith("\n") else "\n") + DEVICE
        Path("recipe.yaml").write_text(text)
        return "recipe.yaml"

    return _write


def _diagnostics_of(path: str, model: str | None = None, **options: float) -> list[Diagnostic]:
    with pytest.raises(RecipeError) as info:
        load_recipe(path, model=model, **options)
    assert str(info.value) == "\n".join(d.format() for d in info.value.diagnostics)
    return info.value.diagnostics


def _only_error(path: str, model: str | None = None, **options: float) -> Diagnostic:
    errors = [d for d in _diagnostics_of(path, model, **options) if d.severity == "error"]
    assert len(errors) == 1, [d.format() for d in errors]
    return errors[0]


@pytest.fixture
def diagnostics_of() -> Callable[..., list[Diagnostic]]:
    """`diagnostics_of(path)`: every diagnostic of a recipe that must fail to load."""
    return _diagnostics_of


@pytest.fixture
def only_error() -> Callable[..., Diagnostic]:
    """`only_error(path)`: the single error of a recipe that must fail to load."""
    return _only_error
