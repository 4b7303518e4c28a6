"""Parser of `kiln compile --model M [--recipe R] --out DIR` (handler in kiln.compile.commands)."""

from __future__ import annotations

import argparse

from kiln.engine.args import EngineArgs


def add_compile_subcommand(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compile",
        help="trace, split, compile and capture the model; write pieces, graph.dot, lint, profile, fusion report",
    )
    EngineArgs.add_cli_args(p)
    p.add_argument("--out", required=True, help="directory for the artifacts (pieces/, graph.dot, lint.txt, ...)")
    p.set_defaults(handler="kiln.compile.commands:cmd_compile")
