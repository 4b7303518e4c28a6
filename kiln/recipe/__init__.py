"""Recipes: the contract between a model author and kiln's graph compiler, proven consistent before compiling
and enforced at run time. See `load_recipe` and the `kiln recipe` command.

The public names load on first use (PEP 562), so that `kiln --help`, which imports `kiln.recipe.cli` for its
parser, does not pull in pydantic, z3 and torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kiln.recipe.diagnostics import Diagnostic, RecipeError
    from kiln.recipe.guards import RecipeGuards, RecipeViolation
    from kiln.recipe.recipe import Recipe, load_recipe, load_recipe_text, recipe_hash
    from kiln.recipe.schema import RecipeSpec, recipe_json_schema

_PUBLIC = {
    "Diagnostic": "kiln.recipe.diagnostics",
    "RecipeError": "kiln.recipe.diagnostics",
    "RecipeGuards": "kiln.recipe.guards",
    "RecipeViolation": "kiln.recipe.guards",
    "Recipe": "kiln.recipe.recipe",
    "load_recipe": "kiln.recipe.recipe",
    "load_recipe_text": "kiln.recipe.recipe",
    "recipe_hash": "kiln.recipe.recipe",
    "RecipeSpec": "kiln.recipe.schema",
    "recipe_json_schema": "kiln.recipe.schema",
}
__all__ = [
    "Diagnostic",
    "Recipe",
    "RecipeError",
    "RecipeGuards",
    "RecipeSpec",
    "RecipeViolation",
    "load_recipe",
    "load_recipe_text",
    "recipe_hash",
    "recipe_json_schema",
]


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'kiln.recipe' has no attribute {name!r}")
