"""The `kiln` command: dispatches to the subcommands each subsystem registers (generate, chat, serve, bench,
loadtest, recipe, compile, debug, kernels). Nothing else lives here: engine flags come from
`kiln.engine.setup.args.EngineArgs`, handlers run through `kiln.command.run_command`."""

from __future__ import annotations

import argparse
import sys

from kiln.bench.cli import add_bench_subcommand
from kiln.command import run_command
from kiln.debug.cli import add_debug_subcommand
from kiln.engine.setup.cli import add_chat_subcommand, add_compile_subcommand, add_generate_subcommand
from kiln.kernels.cli import add_kernels_subcommand
from kiln.recipe.cli import add_recipe_subcommand
from kiln.server.cli import add_loadtest_subcommand, add_serve_subcommand

SUBCOMMANDS = (
    add_generate_subcommand,
    add_chat_subcommand,
    add_serve_subcommand,
    add_bench_subcommand,
    add_loadtest_subcommand,
    add_recipe_subcommand,
    add_compile_subcommand,
    add_debug_subcommand,
    add_kernels_subcommand,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for register in SUBCOMMANDS:
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
