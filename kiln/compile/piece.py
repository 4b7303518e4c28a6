"""A Piece: one sub-graph between splitting ops, runnable three ways and switchable at run time.

`eager` runs the traced FX graph, `compiled` the compiler's output for the dynamic num_tokens, `captured`
the capture for the batch's size (falling back to `compiled` for a size without one). Changing the mode
is an attribute write: compiled code and captures are kept, so a debugger can bisect over modes freely.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from kiln.compile.capture import Capture
from kiln.compile.compiler import CompiledPiece, returns_tuple
from kiln.compile.counters import CompileCounters
from kiln.compile.modes import PieceMode
from kiln.compile.split import PieceGraph

logger = logging.getLogger("kiln")


class Piece(nn.Module):
    def __init__(self, info: PieceGraph, counters: CompileCounters) -> None:
        super().__init__()
        self.index = info.index
        self.info = info
        self.graph: GraphModule = info.graph
        self.counters = counters
        self.mode = PieceMode.CAPTURED
        self.compiled: CompiledPiece | None = None
        self.captures: dict[int, Capture] = {}
        # set while capturing: called with the real arguments of one forward at that size
        self.capture_hook: Callable[[Piece, tuple[Any, ...]], Sequence[torch.Tensor]] | None = None
        self.returns_tuple = returns_tuple(self.graph)
        if not self.returns_tuple:
            _return_tuple(self.graph)  # every compiler then sees (and returns) a sequence
        self.size_arg, self.size_is_int = _size_argument(self.graph)
        self.dynamic_args = _dynamic_arguments(self.graph)
        self.debug = 0  # KILN_DEBUG: 1 logs every launch, 2 also checks that bound inputs did not move

    def num_tokens(self, args: Sequence[Any]) -> int:
        value = args[self.size_arg]
        return value if self.size_is_int else value.shape[0]

    def forward(self, *args: Any) -> Any:
        mode = self.mode
        if self.debug:
            self._debug_launch(args)
        if mode is PieceMode.CAPTURED:
            capture = self.captures.get(self.num_tokens(args))
            if capture is not None:
                self.counters.piece_replays += 1
                out = capture(args)
            elif self.capture_hook is not None:
                out = self.capture_hook(self, args)
            else:
                out = self._compiled_fn()(*args)
        elif mode is PieceMode.COMPILED:
            out = self._compiled_fn()(*args)
        else:
            out = self.graph(*args)
        return out if self.returns_tuple else out[0]

    def run_dynamic(self, *args: Any) -> Any:
        """The compiled (or, in eager mode, traced) graph for whatever num_tokens, ignoring captures."""
        out = self.graph(*args) if self.mode is PieceMode.EAGER else self._compiled_fn()(*args)
        return out if self.returns_tuple else out[0]

    def _debug_launch(self, args: Sequence[Any]) -> None:
        n = self.num_tokens(args)
        capture = self.captures.get(n) if self.mode is PieceMode.CAPTURED else None
        how = "replay" if capture is not None else "dynamic" if self.mode is not PieceMode.EAGER else "eager"
        logger.debug("piece %d (%s) num_tokens=%d mode=%s: %s", self.index, self.describe(), n, self.mode.value, how)
        if capture is not None and self.debug >= 2:
            capture.check_bound_inputs(f"piece {self.index} ({self.describe()})")

    def _compiled_fn(self) -> Callable[..., Sequence[torch.Tensor]]:
        if self.compiled is None:
            raise RuntimeError(
                f"piece {self.index} ({self.describe()}) runs mode {self.mode.value} but was never compiled: "
                "set its mode through GraphRunner.set_piece_modes, which compiles what is missing"
            )
        return self.compiled.fn

    def describe(self) -> str:
        paths = self.info.module_paths
        if not paths:
            return "no module"
        return paths[0] if len(paths) == 1 else f"{paths[0]} .. {paths[-1]}"

    @property
    def num_ops(self) -> int:
        return sum(n.op in ("call_function", "call_method", "call_module") for n in self.graph.graph.nodes)


def _return_tuple(graph: GraphModule) -> None:
    output = next(n for n in reversed(graph.graph.nodes) if n.op == "output")
    output.args = ((output.args[0],),)
    graph.recompile()


def _dynamic_arguments(graph: GraphModule) -> list[int]:
    """Indices of the tensor inputs sized by num_tokens (activations); the rest are parameters and buffers."""
    out = []
    for i, node in enumerate(n for n in graph.graph.nodes if n.op == "placeholder"):
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in value.shape):
            out.append(i)
    return out


def _size_argument(graph: GraphModule) -> tuple[int, bool]:
    """Which argument tells num_tokens at run time: a SymInt input, else a tensor whose dim 0 is symbolic."""
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        if isinstance(node.meta.get("example_value"), torch.SymInt):
            return i, True
    for i, node in enumerate(placeholders):
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor) and value.dim() > 0 and isinstance(value.shape[0], torch.SymInt):
            return i, False
    raise ValueError(f"graph piece has no input sized by num_tokens: {[n.name for n in placeholders]}")
