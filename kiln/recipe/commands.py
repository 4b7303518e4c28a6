"""Handlers of `kiln recipe {validate,init,migrate,schema}` (parser in kiln.recipe.cli).

Exit codes: 0 valid (warnings allowed), 1 invalid, 2 usage error."""

from __future__ import annotations

import argparse
import json
import os
import sys

from kiln.errors import KilnError
from kiln.recipe.diagnostics import Diagnostic, RecipeError
from kiln.recipe.init_recipe import init_recipe_text
from kiln.recipe.migrate import migrate_text
from kiln.recipe.recipe import Recipe, load_recipe
from kiln.recipe.schema import recipe_json_schema

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2


def validate_command(args: argparse.Namespace) -> int:
    if not os.path.isfile(args.recipe):
        print(f"kiln recipe validate: no such file: {args.recipe}", file=sys.stderr)
        return EXIT_USAGE
    recipe: Recipe | None = None
    try:
        recipe = load_recipe(args.recipe, model=args.model)
        diagnostics = recipe.diagnostics
    except RecipeError as exc:
        diagnostics = exc.diagnostics
    if args.json:
        print(json.dumps(_json_result(args.recipe, recipe, diagnostics), indent=2))
    else:
        _print_text(recipe, diagnostics)
    return EXIT_OK if recipe is not None else EXIT_INVALID


def init_command(args: argparse.Namespace) -> int:
    try:
        text = init_recipe_text(args.model, args.out)
    except KilnError as exc:
        print(f"kiln recipe init: {exc}", file=sys.stderr)
        return EXIT_INVALID
    return _emit(text, args.out)


def migrate_command(args: argparse.Namespace) -> int:
    """The kiln recipe on stdout (or --out); a note on stderr for each field not carried. 0 when written."""
    try:
        with open(args.recipe, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        print(f"kiln recipe migrate: cannot read {args.recipe}: {reason}", file=sys.stderr)
        return EXIT_USAGE
    try:
        migration = migrate_text(text, args.recipe, args.out)
    except RecipeError as exc:
        _print_text(None, exc.diagnostics)
        return EXIT_INVALID
    for note in migration.notes:
        print(note.format(args.recipe), file=sys.stderr)
    return _emit(migration.text, args.out)


def schema_command(args: argparse.Namespace) -> int:
    return _emit(json.dumps(recipe_json_schema(), indent=2) + "\n", args.out)


def _emit(text: str, out: str | None) -> int:
    if out is None:
        sys.stdout.write(text)
        return EXIT_OK
    try:
        with open(out, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:
        print(f"kiln recipe: cannot write {out}: {exc.strerror}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {out}", file=sys.stderr)
    return EXIT_OK


def _print_text(recipe: Recipe | None, diagnostics: list[Diagnostic]) -> None:
    for d in diagnostics:
        print(d.format(), file=sys.stderr)
    errors = sum(d.severity == "error" for d in diagnostics)
    warnings = sum(d.severity == "warning" for d in diagnostics)
    if recipe is None:
        print(f"{errors} error{'s' * (errors != 1)}, {warnings} warning{'s' * (warnings != 1)}", file=sys.stderr)
        return
    # NOTE: printed here (stdout, the command's result) whether or not kiln's logger also logged it to stderr.
    print(f"[INFO] Recipe validated: {len(recipe.constraints)} constraints satisfied, 0 conflicts")
    print("[INFO] Witness: " + ", ".join(f"{k}={v}" for k, v in recipe.witness.items()))
    print(
        f"[INFO] Limits: max_num_batched_tokens={recipe.max_num_batched_tokens}, "
        f"max_num_seqs={recipe.max_num_seqs}, max_model_len={recipe.max_model_len}"
    )
    print(f"[INFO] Recipe hash: {recipe.hash}")


def _json_result(file: str, recipe: Recipe | None, diagnostics: list[Diagnostic]) -> dict:
    result: dict = {"file": file, "valid": recipe is not None, "diagnostics": [d.to_json() for d in diagnostics]}
    if recipe is not None:
        result.update(
            hash=recipe.hash,
            witness=recipe.witness,
            constraints=len(recipe.constraints),
            max_num_batched_tokens=recipe.max_num_batched_tokens,
            max_num_seqs=recipe.max_num_seqs,
            max_model_len=recipe.max_model_len,
        )
    return result
