"""`python -m kiln.launch --model-path M [--enable-piecewise-graph] [--port P]`: the seed-style server entry.

Same server as `kiln serve`; `--model-path` is the seed's name for `--model`.
"""

from __future__ import annotations

import argparse
import sys

from kiln.command import run_command
from kiln.engine.setup.args import EngineArgs
from kiln.server.cli import add_server_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kiln.launch", description=__doc__)
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--model-path", dest="model", default=argparse.SUPPRESS, help="same as --model")
    add_server_args(parser)
    parser.set_defaults(handler="kiln.server.launcher:run_server")
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
