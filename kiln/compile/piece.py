"""A Piece: one sub-graph between splitting ops, runnable three ways and switchable at run time.

`eager` runs the traced FX graph, `compiled` the compiler's output for the dynamic num_tokens, `captured`
the capture for the batch's size (falling back to `compiled` for a size without one). Changing the mode
is one call: compiled code and captures are kept, so a debugger can bisect over modes freely.

A piece changes only through its own methods (`set_mode`, `set_compiled`, `add_capture`, `set_capture_hook`,
`set_hooks`, `set_trace_level`, `rewrite`); its state is read through read-only properties. Who calls them: the
graph executor (modes and compiled code, kiln.executor.graph), the capturer (captures, kiln.compile.capturer), the
full decode graph (its own pieces, kiln.compile.full_graph) and the debugger's controls (hooks, rewrites and trace
level, kiln.executor.controls).

Hooks (used by the debugger's taps and fault injection): `before(piece, args) -> args` rewrites a launch's
arguments; `after(piece, outputs)` sees every output the piece's graph returns, including extra ones a rewrite
added (`GraphControls.rebuild`). The piece then returns its original outputs only, so a rewritten graph with
extra outputs is invisible to the rest of the forward.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from kiln.compile.capture import Capture
from kiln.compile.compiler import CompiledPiece, make_tuple_output
from kiln.compile.counters import CompileCounters
from kiln.compile.modes import PieceMode
from kiln.compile.split import SplitPiece
from kiln.model.forward_context import get_forward_context
from kiln.platforms import platform_of

logger = logging.getLogger("kiln")

BeforeHook = Callable[["Piece", tuple[Any, ...]], tuple[Any, ...]]
AfterHook = Callable[["Piece", Sequence[torch.Tensor]], None]


CaptureHook = Callable[["Piece", tuple[Any, ...]], Sequence[torch.Tensor]]
CaptureKey = Callable[["Piece", Sequence[Any]], Hashable]


class Piece(nn.Module):
    def __init__(
        self,
        info: SplitPiece,
        counters: CompileCounters,
        label: str | None = None,
        size_slot: int | None = None,
        capture_key: CaptureKey | None = None,
    ) -> None:
        """`label`: how logs and errors name it (default `piece K`); `size_slot`: the int input that tells num_tokens
        (default: found in the graph, `_size_argument`); `capture_key(piece, args)`: what captures are keyed by
        (default num_tokens)."""
        super().__init__()
        self.index = info.index
        self.label = label or f"piece {info.index}"
        self.info = info
        self.counters = counters
        self._graph: GraphModule = info.graph  # what eager mode runs
        self._compile_source: GraphModule = info.graph  # what compiled code is built from (a fault may differ)
        self._persistent = True  # compiled through the on-disk cache; False once a rewrite changed the graph
        self._mode = PieceMode.CAPTURED
        self._compiled: CompiledPiece | None = None
        self._static_compiled: dict[int, CompiledPiece] = {}  # num_tokens -> compiled for that static size
        self._captures: dict[Hashable, Capture] = {}  # by `capture_key(piece, args)`
        self._capture_key: CaptureKey = capture_key or Piece.num_tokens
        self._capture_hook: CaptureHook | None = None  # set while capturing: called with one forward's arguments
        self.returns_tuple = make_tuple_output(self._graph)  # every compiler then sees (and returns) a sequence
        self.size_arg, self.size_is_int = (size_slot, True) if size_slot is not None else _size_argument(self._graph)
        self.num_outputs = _num_outputs(self._graph)
        self.dynamic_args = _dynamic_arguments(self._graph)
        self._debug = 0  # trace mode (KILN_DEBUG, recipe debug_mode): log every launch, check replay inputs
        self._before: BeforeHook | None = None
        self._after: AfterHook | None = None

    # -- state, read-only ------------------------------------------------------------------------------------------
    @property
    def graph(self) -> GraphModule:
        return self._graph

    @property
    def compile_source(self) -> GraphModule:
        return self._compile_source

    @property
    def persistent(self) -> bool:
        return self._persistent

    @property
    def mode(self) -> PieceMode:
        return self._mode

    @property
    def compiled(self) -> CompiledPiece | None:
        """The compiled code for any num_tokens (None until compiled)."""
        return self._compiled

    @property
    def static_compiled(self) -> Mapping[int, CompiledPiece]:
        return MappingProxyType(self._static_compiled)

    @property
    def captures(self) -> Mapping[Hashable, Capture]:
        return MappingProxyType(self._captures)

    @property
    def trace_level(self) -> int:
        return self._debug

    # -- changes ---------------------------------------------------------------------------------------------------
    def set_mode(self, mode: PieceMode) -> None:
        """Run `mode` from the next launch; a non-eager mode needs compiled code (`set_compiled`) to run."""
        self._mode = mode

    def set_compiled(self, compiled: CompiledPiece, static_size: int | None = None) -> None:
        """The compiled code for any num_tokens, or with `static_size` the code compiled for that size alone."""
        if static_size is None:
            self._compiled = compiled
        else:
            self._static_compiled[static_size] = compiled

    def add_capture(self, key: Hashable, capture: Capture) -> None:
        """Replay `capture` for launches whose `capture_key` is `key`."""
        self._captures[key] = capture

    def set_capture_hook(self, hook: CaptureHook | None) -> None:
        """While capturing: a captured-mode launch without a capture calls `hook(piece, args)`; None ends it."""
        self._capture_hook = hook

    def set_hooks(self, before: BeforeHook | None = None, after: AfterHook | None = None) -> None:
        """Hooks around every launch (module docstring); None removes one."""
        self._before, self._after = before, after

    def set_trace_level(self, level: int) -> None:
        """Trace mode (kiln.debug.trace): log every launch and check replay inputs when level >= 1."""
        self._debug = level

    def rewrite(self, graph: GraphModule, compiled_only: bool = False) -> None:
        """Run `graph` from now on (or only build compiled code from it): it must take the same inputs and return
        the piece's outputs first. Compiled code and captures are dropped; the owner compiles them again."""
        make_tuple_output(graph)
        if _num_outputs(graph) < self.num_outputs:
            raise ValueError(f"{self.label}: a rewrite must keep the piece's {self.num_outputs} outputs first")
        if not compiled_only:
            self._graph = graph
        self._compile_source = graph
        self._persistent = False
        self._compiled = None
        self._static_compiled = {}
        self._captures = {}

    # -- run -------------------------------------------------------------------------------------------------------
    def num_tokens(self, args: Sequence[Any]) -> int:
        value = args[self.size_arg]
        return value if self.size_is_int else value.shape[0]

    def forward(self, *args: Any) -> Any:
        if self._before is not None:
            args = self._before(self, args)
        out = self._traced_forward(args) if self._debug else self._launch(args)
        if self._after is not None:
            self._after(self, out)
        if len(out) != self.num_outputs:
            out = out[: self.num_outputs]
        return out if self.returns_tuple else out[0]

    def _launch(self, args: Sequence[Any]) -> Any:
        mode = self._mode
        if mode is PieceMode.CAPTURED:
            capture = self._captures.get(self._capture_key(self, args))
            if capture is not None:
                self.counters.piece_replays += 1
                out = capture(args)
            elif self._capture_hook is not None:
                out = self._capture_hook(self, args)
            else:
                out = self._compiled_fn()(*args)
        elif mode is PieceMode.COMPILED:
            out = self._compiled_fn()(*args)
        else:
            out = self._graph(*args)
        return out

    def run_dynamic(self, *args: Any) -> Any:
        """The compiled (or, in eager mode, traced) graph for whatever num_tokens, ignoring captures."""
        out = self._graph(*args) if self._mode is PieceMode.EAGER else self._compiled_fn()(*args)
        return out[: self.num_outputs] if self.returns_tuple else out[0]

    def _traced_forward(self, args: tuple[Any, ...]) -> Any:
        """KILN_DEBUG (trace mode): check a replay's input buffers, run, and log the launch with its time."""
        n = self.num_tokens(args)
        capture = self._captures.get(self._capture_key(self, args)) if self._mode is PieceMode.CAPTURED else None
        if capture is not None:
            launch = "replay"
            capture.check_bound_inputs(f"{self.label} ({self.describe()}) num_tokens={n}")
        elif self._mode is PieceMode.CAPTURED and self._capture_hook is not None:
            launch = "capture"
        else:
            launch = "eager" if self._mode is PieceMode.EAGER else "dynamic"
        real = get_forward_context().attn_metadata.num_actual_tokens
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
        platform = platform_of(device)
        platform.synchronize(device)
        start = time.perf_counter()
        out = self._launch(args)
        platform.synchronize(device)
        logger.info(
            "%s (%s) mode=%s launch=%s num_tokens=%d padded=%d time=%.3f ms",
            self.label,
            self.describe(),
            self._mode.value,
            launch,
            real,
            n,
            (time.perf_counter() - start) * 1e3,
        )
        return out

    def _compiled_fn(self) -> Callable[..., Sequence[torch.Tensor]]:
        if self._compiled is None:
            raise RuntimeError(
                f"{self.label} ({self.describe()}) runs mode {self._mode.value} but was never compiled: "
                "set its mode through GraphExecutor.set_piece_modes, which compiles what is missing"
            )
        return self._compiled.fn

    def describe(self) -> str:
        paths = self.info.module_paths
        if not paths:
            return "no module"
        return paths[0] if len(paths) == 1 else f"{paths[0]} .. {paths[-1]}"

    @property
    def num_ops(self) -> int:
        return sum(n.op in ("call_function", "call_method", "call_module") for n in self._graph.graph.nodes)


def _num_outputs(graph: GraphModule) -> int:
    return len(next(n for n in reversed(graph.graph.nodes) if n.op == "output").args[0])


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
