"""How a `kiln` command runs: its handler is found by name and called; a KilnError is one line, never a traceback.

Subcommand parsers (each subsystem's `cli.py`) name their handler as `"package.module:function"` in a
`handler` default instead of importing it, so `kiln --help` builds every parser without loading torch; the
handler's module (its `commands.py`) is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from kiln.errors import KilnError

Handler = Callable[[argparse.Namespace], int]


def resolve_handler(spec: str) -> Handler:
    """`"kiln.debug.commands:cmd_diff"` -> the function (kiln's own parsers set these; never user text)."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def run_command(args: argparse.Namespace) -> int:
    """Run the handler the parsed arguments name; a KilnError becomes one line on stderr and exit 1."""
    try:
        return resolve_handler(args.handler)(args)
    except KilnError as exc:
        print(f"kiln: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
