"""Small functions compiled on their own for static shapes: the weight product that the static-size choice times
against BLAS and the compiled one-row logits head run (kiln.kernels.static_sizes, kiln.kernels.head), and the
compiled candidates of the packed kernel table (kiln.kernels.packed).

Compiled for one or two static rows, the DecodeGemv pass (kiln.compile.passes) turns `x @ W.T` into a
vectorized reduction over W; the logits head (the largest single weight, streamed once per decoded token) runs
that way when the kernel plan picked static size 1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.fx import GraphModule

from kiln.compile.compiler import CompiledPiece, PieceCompiler


def _product(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor]:
    return (torch.mm(hidden, weight.t()).float(),)


def product_graph(weight: torch.Tensor, rows: int = 1) -> GraphModule:
    """`hidden [rows, in] @ weight.T` (fp32 out) traced by dynamo for static shapes."""
    hidden = torch.zeros(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
    return trace_static(_product, hidden, weight)


def trace_static(fn: Callable[..., tuple], *args: torch.Tensor) -> GraphModule:
    """`fn(*args)` traced by dynamo into one graph for these static shapes (for a piece compiler to compile)."""
    graphs: list[GraphModule] = []

    def grab(gm: GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(gm)
        return gm.forward

    # NOTE: dynamo keys its cache on fn's code: tracing it for many shapes must not hit the recompile limit.
    with torch.inference_mode(), torch._dynamo.config.patch(recompile_limit=1 << 16):
        torch.compile(fn, backend=grab, fullgraph=True, dynamic=False)(*args)
    return graphs[0]


class CompiledProduct:
    """Calls a compiled product with its arguments in the order dynamo traced them."""

    def __init__(self, compiled: CompiledPiece, graph: GraphModule, weight: torch.Tensor) -> None:
        self.compiled = compiled
        self.weight = weight
        first = next(n for n in graph.graph.nodes if n.op == "placeholder")
        # NOTE: dynamo orders a graph's inputs its own way (here the weight first): find it by its shape.
        self.weight_first = tuple(first.meta["example_value"].shape) == tuple(weight.shape)

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """`hidden @ weight.T` (default: the weight it was built with; another must have the same strides)."""
        w = self.weight if weight is None else weight
        args = (w, hidden) if self.weight_first else (hidden, w)
        return self.compiled.fn(*args)[0]


class Compiled:
    """`fn(*args)` compiled by the piece compiler for these shapes, called with its inputs in dynamo's order. The
    arguments numbered in `dynamic` have a symbolic first dimension (a weight's output rows, equal in all of them):
    one compile serves every layout and tile that differs only there (the packed kernel table's candidates: the
    dequantization once per bits and group, the one-row reduction once per weight form and row count)."""

    def __init__(
        self, fn: Callable[..., torch.Tensor], compiler: PieceCompiler, rows: int | None, *args, dynamic=()
    ) -> None:
        examples = [_stand_in(a) if i in dynamic else a for i, a in enumerate(args)]
        for i in dynamic:
            torch._dynamo.mark_dynamic(
                examples[i], 0
            )  # NOTE: on stand-ins: the mark stays on a tensor for later traces
        graph = trace_static(lambda *a: (fn(*a),), *examples)
        self.fn = compiler.compile(graph, rows).fn
        self.sized_by = dynamic[0] if dynamic else None  # the argument whose first dimension is the symbolic size
        shapes = [tuple(a.shape) for a in examples]
        placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
        # NOTE: dynamo orders a graph's inputs its own way; match them to the arguments by name (L_a_0_, ...); a
        # symbolic size is the first dimension of argument `sized_by`
        self.order = [ROWS if _is_size(n) else int(n.target.rstrip("_").rsplit("_", 1)[-1]) for n in placeholders]
        tensors = [(i, n) for i, n in zip(self.order, placeholders, strict=True) if i != ROWS]
        assert [shapes[i] for i, _ in tensors] == [tuple(n.meta["example_value"].shape) for _, n in tensors]

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        return self.fn(*(args[self.sized_by].shape[0] if i == ROWS else args[i] for i in self.order))[0]


ROWS = -1  # Compiled.order's mark of the symbolic row count among the inputs


def _is_size(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("example_value"), torch.SymInt)


def _stand_in(a: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of `a`'s size, strides and dtype, to trace with (nothing is marked on `a`)."""
    return torch.empty_strided(a.size(), a.stride(), dtype=a.dtype, device=a.device)


def shared_compile(fn: Callable[..., torch.Tensor], compiler: PieceCompiler, *args: torch.Tensor) -> Compiled:
    """`fn(*args)` compiled with the weight's output rows symbolic (the last three arguments: codes, scales, offsets;
    any before them, e.g. x, static): traced and compiled once per form (each tensor's dtype, and its sizes and
    strides past a weight's rows) where `compiler` keeps a memo (CompileOnce), so the table's layouts, row counts and
    tiles share one (a trace costs ~0.13 s even where the compile is shared; a compile ~0.8 s, and the reduction's
    code and speed are a static compile's: 82 vs 87 µs a call for 3072x576 4-bit at one row, equal outputs)."""
    weight = range(len(args) - 3, len(args))
    memo = getattr(compiler, "memo", None)
    form = tuple((t.dtype, t.shape[i in weight :], t.stride()[i in weight :]) for i, t in enumerate(args))
    key = (fn.__qualname__, form)
    if memo is not None and key in memo:
        return memo[key]
    compiled = Compiled(fn, compiler, None, *args, dynamic=tuple(weight))
    if memo is not None:
        memo[key] = compiled
    return compiled
