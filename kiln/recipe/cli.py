"""Parser of `kiln recipe {validate,init,migrate,schema}` (handlers in kiln.recipe.commands); also
`python -m kiln.recipe.cli validate recipe.yaml`, the same as `kiln recipe validate recipe.yaml`."""

from __future__ import annotations

import argparse
import sys

from kiln.command import run_command
from kiln.config import LORA_DTYPE_NAMES

EXIT_USAGE = 2


def add_recipe_subcommand(subparsers: argparse._SubParsersAction) -> None:
    """Register `recipe {validate,init,migrate,schema}`; each handler returns an exit code."""
    recipe = subparsers.add_parser("recipe", help="validate, create and describe recipes")
    commands = recipe.add_subparsers(dest="recipe_command", required=True, metavar="{validate,init,migrate,schema}")
    validate = commands.add_parser("validate", help="check a recipe; print FILE:LINE:COL diagnostics")
    validate.add_argument("recipe", help="the recipe YAML file")
    validate.add_argument("--model", help="checkpoint to check against (overrides the recipe's model.path)")
    validate.add_argument("--json", action="store_true", help="print the result as JSON")
    validate.set_defaults(handler="kiln.recipe.commands:validate_command")
    init = commands.add_parser("init", help="write a valid recipe for a checkpoint")
    init.add_argument("--model", default="default", help='a .gguf file, an HF directory or "default"')
    init.add_argument("--out", help="write here instead of stdout")
    _add_lora_flags(init)
    init.set_defaults(handler="kiln.recipe.commands:init_command")
    migrate = commands.add_parser(
        "migrate",
        help="convert a community-shaped recipe to kiln's schema, or rewrite a kiln recipe's retired keys "
        "(graph.piecewise becomes graph.mode)",
    )
    migrate.add_argument("recipe", help="the recipe YAML file (community-shaped, or kiln's with retired keys)")
    migrate.add_argument("--out", help="write here instead of stdout")
    migrate.set_defaults(handler="kiln.recipe.commands:migrate_command")
    schema = commands.add_parser("schema", help="print the recipe JSON Schema (for editors)")
    schema.add_argument("--out", help="write here instead of stdout")
    schema.set_defaults(handler="kiln.recipe.commands:schema_command")


def _add_lora_flags(init: argparse.ArgumentParser) -> None:
    """`recipe init`'s LoRA flags, named as `kiln serve`'s: with --enable-lora the recipe gets a `lora:` section."""
    lora = init.add_argument_group("LoRA")
    lora.add_argument("--enable-lora", action="store_true", help="write a lora: section (LoRA adapters turned on)")
    lora.add_argument("--max-loras", type=_positive_int, default=None, help="lora.max_loras (default 1)")
    lora.add_argument("--max-lora-rank", type=_positive_int, default=None, help="lora.max_rank (default 16)")
    lora.add_argument(
        "--lora-target-modules",
        type=_names,
        default=None,
        metavar="NAME,...",
        help="lora.target_modules, e.g. q_proj,v_proj (default: every layer kiln adapts)",
    )
    lora.add_argument(
        "--lora-dtype",
        choices=LORA_DTYPE_NAMES,
        default=None,
        help="lora.dtype, the buffers' dtype (default auto: the weights')",
    )


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated module names, got {text!r}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kiln")
    add_recipe_subcommand(parser.add_subparsers(dest="command", required=True))
    try:
        args = parser.parse_args(["recipe", *(sys.argv[1:] if argv is None else argv)])
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 for --help
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
