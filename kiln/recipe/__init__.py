"""Recipes: the contract between a model author and kiln's graph compiler, proven consistent before compiling
and enforced at run time. See `load_recipe` and the `kiln recipe` command."""

from kiln.recipe.diagnostics import Diagnostic, RecipeError
from kiln.recipe.guards import RecipeGuards, RecipeViolation
from kiln.recipe.recipe import Recipe, load_recipe, load_recipe_text, recipe_hash
from kiln.recipe.schema import RecipeSpec, recipe_json_schema

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
