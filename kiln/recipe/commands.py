"""Handlers of `kiln recipe {validate,init,migrate,schema}` (parser in kiln.recipe.cli).

Exit codes: 0 valid (warnings allowed), 1 invalid, 2 usage error."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

from kiln.config import LoRAConfig
from kiln.errors import ConfigError, KilnError
from kiln.recipe.diagnostics import Diagnostic, RecipeError
from kiln.recipe.init_recipe import init_recipe_text
from kiln.recipe.migrate import migrate_text
from kiln.recipe.placement import Placement, StageLoad, format_bytes, recipe_placement
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
    placement = recipe_placement(recipe) if recipe is not None else None
    if args.json:
        print(json.dumps(_json_result(args.recipe, recipe, diagnostics, placement), indent=2))
    else:
        _print_text(recipe, diagnostics)
        if recipe is not None and placement is not None:
            _print_placement(recipe, placement)
    return EXIT_OK if recipe is not None else EXIT_INVALID


def init_command(args: argparse.Namespace) -> int:
    try:
        text = init_recipe_text(args.model, args.out, _init_lora(args))
    except KilnError as exc:
        print(f"kiln recipe init: {exc}", file=sys.stderr)
        return EXIT_INVALID
    return _emit(text, args.out)


def _init_lora(args: argparse.Namespace) -> LoRAConfig | None:
    """`recipe init`'s LoRA flags as the section's sizes (None without --enable-lora; a size flag without it is a
    ConfigError naming the flag)."""
    if not args.enable_lora:
        flags = ("--max-loras", "--max-lora-rank", "--lora-target-modules", "--lora-dtype")
        values = (args.max_loras, args.max_lora_rank, args.lora_target_modules, args.lora_dtype)
        given = [flag for flag, value in zip(flags, values, strict=True) if value is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} without --enable-lora: add --enable-lora to write a lora: section")
        return None
    defaults = LoRAConfig()
    return LoRAConfig(
        enabled=True,
        max_loras=args.max_loras or defaults.max_loras,
        max_lora_rank=args.max_lora_rank or defaults.max_lora_rank,
        target_modules=args.lora_target_modules,
        dtype=args.lora_dtype or defaults.dtype,
    )


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


def _print_placement(recipe: Recipe, placement: Placement) -> None:
    """The load report: one line for one device; otherwise a line per stage and a warning when unbalanced."""
    kv = (
        f"KV for {placement.kv_tokens} tokens (max_pages {recipe.max_pages} x block_size {recipe.block_size}, "
        f"{recipe.kv_cache_dtype})"
    )
    if placement.world_size == 1:
        (stage,) = placement.stages
        print(
            f"[INFO] Placement: one device holds all {len(stage.layers)} decoder layers: weights "
            f"{format_bytes(stage.held_bytes)}, {kv} {format_bytes(stage.kv_bytes)}"
        )
        return
    stages, tensor = placement.pipeline, placement.tensor
    print(
        f"[INFO] Placement: {stages} pipeline stage{'s' * (stages != 1)} x {tensor} tensor rank{'s' * (tensor != 1)}"
        f" = {placement.world_size} devices; {kv}; weights at run time, each checkpoint tensor counted once "
        f"({format_bytes(placement.total_weight_bytes)} in all)"
    )
    for stage in placement.stages:
        print(f"[INFO]   {_stage_line(placement, stage)}")
    if placement.warning is not None:
        print(f"[WARNING] {placement.warning}")


def _stage_line(placement: Placement, stage: StageLoad) -> str:
    """What one stage holds: its layers, the tensors outside them, its weight and KV bytes."""
    first, last = stage.device_id == 0, stage.device_id == placement.pipeline - 1
    extras = ["embedding", *placement.other_tensors] if first else []
    if last:
        extras.append("final norm" if placement.tied_head else "final norm, lm_head")
    holds = f"decoder_layer_{stage.layers[0]}..{stage.layers[-1]} ({len(stage.layers)} layers)"
    holds += "".join(f" + {extra}" for extra in extras)
    weights = format_bytes(stage.weight_bytes)
    if stage.head_copy_bytes:
        weights += f" + {format_bytes(stage.head_copy_bytes)} (the tied embedding again, as its head)"
    if placement.tensor == 1:
        return f"device {stage.device_id}: {holds}: weights {weights}, KV {format_bytes(stage.kv_bytes)}"
    return (
        f"stage {stage.device_id} ({placement.tensor} devices): {holds}: weights {weights}, "
        f"{format_bytes(stage.weight_bytes_per_device)} per device of the stage; KV {format_bytes(stage.kv_bytes)}, "
        f"{format_bytes(stage.kv_bytes_per_device)} per device of the stage"
    )


def _json_result(
    file: str, recipe: Recipe | None, diagnostics: list[Diagnostic], placement: Placement | None = None
) -> dict:
    result: dict = {"file": file, "valid": recipe is not None, "diagnostics": [d.to_json() for d in diagnostics]}
    if placement is not None:
        stages = [{**asdict(s), "layers": list(s.layers)} for s in placement.stages]
        result["placement"] = {"tensor": placement.tensor, "kv_tokens": placement.kv_tokens, "stages": stages}
        result["placement"]["warning"] = placement.warning
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
