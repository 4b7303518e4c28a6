"""Recipes: the contract between a model author and kiln's graph compiler, proven consistent before compiling
and enforced at run time. See `load_recipe` and the `kiln recipe` command.

The public names load on first use (PEP 562), so that `kiln --help`, which imports `kiln.recipe.cli` for its
parser, does not pull in pydantic, z3 and torch.

analysis.py       solver-backed findings: conflicts (minimal unsat cores with lines), redundant constraints, a
                  witness and the maximum of each run-time symbol
capacity.py       cross-section checks that need the solver: capture sizes, seq_len and batch size against limits
checkpoint.py     checks against the checkpoint, from its headers only: stored tensor types, model symbols, modules
cli.py            parser of `kiln recipe {validate,init,migrate,schema}` (handlers in commands.py)
commands.py       handlers of `kiln recipe {validate,init,migrate,schema}`; exit 0 valid, 1 invalid, 2 usage error
community.py      the community recipe shape: where each of its keys lives in a kiln recipe, or why it has no place
constraints.py    the recipe's constraints, parsed and placed at the file line and column where their text starts
contract.py       every recipe field acts or is refused; the hardware asked for is checked against the machine
diagnostics.py    compiler-style diagnostics: `FILE:LINE:COL: severity: message`, the source line and a caret
evaluate.py       a whitelisted constraint evaluated on integers with Python's own semantics
expr.py           the constraint language: Python syntax parsed with `ast`, checked against a whitelist, never run
guards.py         run-time enforcement of the constraints: a violation fails only its request (or step)
init_recipe.py    `kiln recipe init`: a valid, commented recipe for a checkpoint, derived from its header
lora_checks.py    the lora section against the placement, the checkpoint's layers, the memory budget and the
                  solver's batch bound
machine.py        what the machine running kiln offers: CPU ISA features and the CUDA device's compute capability
migrate.py        `kiln recipe migrate`: a recipe in the community shape rewritten in kiln's schema
migrate_retired.py  `kiln recipe migrate` on a kiln recipe: retired keys (graph.piecewise) rewritten in place
migrate_carry.py  the carrying half of `kiln recipe migrate`: each value written where community.py says kiln keeps it
placement.py      the load report of a placement: what each pipeline stage (and device) holds, from tensor shapes
recipe.py         `load_recipe`: parse, check the schema, prove the constraints consistent, check checkpoint and
                  sections; a frozen Recipe
schema.py         the recipe schema (version 1) as pydantic models: strict types, unknown keys forbidden
schema_check.py   schema validation with diagnostics for people: line and column, "did you mean", community keys
sections.py       cross-section checks that need no solver: splitting ops, fusion groups, input tensors,
                  quantization group size, the memory budget
solver.py         the constraint system in Z3: minimal unsat cores, implied constraints, run-time symbol maxima
source.py         recipe YAML with source positions: every key and value keeps its line and column
stages.py         pipeline stages: which decoder layers each stage holds, and the checks that make it runnable
z3_encode.py      a whitelisted constraint translated to Z3 exactly (Python's floor `//` and `%`, division by zero)
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
