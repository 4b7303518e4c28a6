"""Execution modes a bench compares: the engine flags of each, on top of the flags the user gave."""

from __future__ import annotations

import argparse
from typing import Any

from kiln.engine.setup.args import EngineArgs
from kiln.graph_mode import GRAPH_MODES

# The EngineArgs each mode sets: one graph mode (kiln.config.GRAPH_MODES, eager included). NOTE: every alias is
# cleared, so that `--modes eager` stays eager even beside --enable-piecewise-graph.
MODE_ARGS: dict[str, dict[str, Any]] = {
    mode: {"enable_piecewise_graph": False, "full_graph": False, "enforce_eager": False, "graph_mode": mode}
    for mode in GRAPH_MODES
}


def engine_args_for_mode(args: argparse.Namespace, mode: str) -> EngineArgs:
    """The engine arguments of one execution mode, from the engine flags in `args`."""
    return EngineArgs.from_cli_args(args, **MODE_ARGS[mode])
