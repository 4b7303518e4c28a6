"""Execution modes a bench compares: the engine flags of each, on top of the flags the user gave."""

from __future__ import annotations

import argparse

from kiln.engine.args import EngineArgs

# The EngineArgs each mode sets. NOTE: every graph flag is set, so that `--modes eager` stays eager even
# beside --enable-piecewise-graph.
MODE_ARGS: dict[str, dict[str, bool]] = {
    "eager": {"enable_piecewise_graph": False, "full_graph": False},
    "piecewise": {"enable_piecewise_graph": True, "full_graph": False},
    "full": {"enable_piecewise_graph": False, "full_graph": True},
}


def engine_args_for_mode(args: argparse.Namespace, mode: str) -> EngineArgs:
    """The engine arguments of one execution mode, from the engine flags in `args`."""
    return EngineArgs.from_cli_args(args, **MODE_ARGS[mode])
