"""Execution modes a bench compares: one LLM per mode, built from the engine flags through one hook."""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import kiln.cli as kiln_cli
from kiln.errors import KilnError

if TYPE_CHECKING:
    from kiln.engine.llm import LLM

# The LLM(...) keyword that turns each mode on; eager is the plain LLM.
MODE_FLAGS: dict[str, str | None] = {"eager": None, "piecewise": "enable_piecewise_graph", "full": "full_graph"}


def make_llm_for_mode(args: argparse.Namespace, mode: str) -> LLM:
    """Build the LLM for one execution mode from the engine flags in `args`."""
    from kiln.engine.llm import LLM

    if mode not in MODE_FLAGS:
        raise KilnError(f"unknown bench mode {mode!r}: expected one of {', '.join(MODE_FLAGS)}")
    flag = MODE_FLAGS[mode]
    supported = [f for f in MODE_FLAGS.values() if f and _accepts(LLM, f) and _accepts(kiln_cli.make_llm, f)]
    if flag is not None and flag not in supported:
        raise KilnError(
            f"mode {mode!r} needs graph mode support: kiln.LLM / kiln.cli.make_llm take no {flag}= option yet; "
            "use --modes eager"
        )
    # NOTE: every graph flag is set, so that `--modes eager` stays eager even beside --enable-piecewise-graph.
    return kiln_cli.make_llm(args, **{f: f == flag for f in supported})


def _accepts(fn: Callable[..., Any], keyword: str) -> bool:
    params = inspect.signature(fn).parameters
    return keyword in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
