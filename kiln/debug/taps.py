"""Taps: the tensors at module boundaries, recorded the same way in eager mode and in every piece mode.

Boundaries, in model order: `embed` (model.embed_tokens), `layers.K.attn` (model.layers.K.self_attn),
`layers.K.mlp` (model.layers.K.mlp), `norm` (model.norm) and `logits` (the head on the sampled rows).

Design (the simplest that survives graph capture):
- Eager: forward hooks on those modules.
- Graph mode: the split is left exactly as it is. A boundary's value in the traced graph is the last node of the
  module's subtree in execution order (`self_attn`'s is its `o_proj`, which lives in the piece after the attention
  op). Each piece's FX graph is copied with the boundary nodes it holds appended to its outputs: the copy gains
  outputs only, never an op, so the partition and every piece's structure key stay the same. Eager, compiled and
  captured pieces then all *return* the boundary values — from a capture they come back in its static output
  buffers, which is why hooks (and dump ops with side effects) never fire inside captured graphs and outputs do.
- A `TapProbe` module takes the piece's place in the split graph: it strips the extra outputs and records them.
- Tapped graphs are compiled by the debug session itself, never through the on-disk compile cache, so the cache
  only ever holds production graphs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node

from kiln.compile.piece import Piece
from kiln.compile.split import _clean_path
from kiln.model.forward_context import get_forward_context

LOGITS = "logits"


@dataclass(frozen=True)
class Boundary:
    name: str  # `embed`, `layers.3.attn`, `layers.3.mlp`, `norm`, `logits`
    module_path: str  # the model module whose output it is (`model.layers.3.mlp`); `lm_head` for logits
    piece: int | None = None  # the graph piece that computes it (None for logits: the head runs outside the graph)


def model_boundaries(model: nn.Module) -> list[Boundary]:
    """The boundaries of a Llama-family model, in the order the forward computes them."""
    out = [Boundary("embed", "model.embed_tokens")]
    for k in range(len(model.model.layers)):
        out.append(Boundary(f"layers.{k}.attn", f"model.layers.{k}.self_attn"))
        out.append(Boundary(f"layers.{k}.mlp", f"model.layers.{k}.mlp"))
    out.append(Boundary("norm", "model.norm"))
    out.append(Boundary(LOGITS, "lm_head"))
    return out


class TapRecorder:
    """Collects boundary values per forward step; records only inside `step()`, so captures record nothing."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []
        self._active = False

    @contextmanager
    def step(self) -> Iterator[dict[str, torch.Tensor]]:
        self.steps.append({})
        self._active = True
        try:
            yield self.steps[-1]
        finally:
            self._active = False

    def record(self, name: str, value: torch.Tensor, rows: int | None = None) -> None:
        """Keep a host copy of the first `rows` rows (the real tokens; the rest is capture padding)."""
        if not self._active:
            return
        if rows is None:
            rows = get_forward_context().attn_metadata.num_actual_tokens
        self.steps[-1][name] = value[:rows].detach().to("cpu", copy=True)

    def take(self) -> list[dict[str, torch.Tensor]]:
        steps, self.steps = self.steps, []
        return steps


@contextmanager
def eager_taps(model: nn.Module, boundaries: Sequence[Boundary], recorder: TapRecorder) -> Iterator[None]:
    """Forward hooks recording every boundary (but logits, recorded by the caller) while the block runs."""
    handles = []
    for b in boundaries:
        if b.name == LOGITS:
            continue

        def hook(_m: nn.Module, _args: Any, output: torch.Tensor, name: str = b.name) -> None:
            recorder.record(name, output)

        handles.append(model.get_submodule(b.module_path).register_forward_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _innermost_module(node: Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return _clean_path(list(stack.values())[-1][0]) if stack else ""


def locate_boundaries(pieces: Sequence[Piece], boundaries: Sequence[Boundary]) -> dict[str, tuple[int, str]]:
    """Boundary name -> (piece index, node name) of the last node of the boundary module's subtree.

    Raises ValueError naming the boundaries whose module left no node in the traced graph.
    """
    by_path = {b.module_path: b.name for b in boundaries if b.name != LOGITS}
    found: dict[str, tuple[int, str]] = {}
    for piece in pieces:
        for node in piece.graph.graph.nodes:
            if node.op not in ("call_function", "call_method", "call_module"):
                continue
            parts = _innermost_module(node).split(".")
            for i in range(1, len(parts) + 1):
                name = by_path.get(".".join(parts[:i]))
                if name is not None:
                    found[name] = (piece.index, node.name)
    missing = [name for name in by_path.values() if name not in found]
    if missing:
        raise ValueError(f"boundaries {missing} have no node in the traced graph: their modules never ran")
    return found


def copy_graph(graph: GraphModule) -> tuple[GraphModule, dict[str, Node]]:
    """A copy of `graph` (shared parameters, shallow-copied node meta) and its nodes by the original's names."""
    new_graph = copy.deepcopy(graph.graph)
    names = {old.name: new for old, new in zip(graph.graph.nodes, new_graph.nodes, strict=True)}
    return GraphModule(graph, new_graph), names


def with_extra_outputs(graph: GraphModule, node_names: Sequence[str]) -> GraphModule:
    """A copy of `graph` returning its own (tuple) outputs followed by the named nodes."""
    tapped, nodes = copy_graph(graph)
    output = next(n for n in reversed(tapped.graph.nodes) if n.op == "output")
    outs = output.args[0]
    if not isinstance(outs, (tuple, list)):
        raise ValueError("piece graphs must return a tuple before taps are added (Piece rewrites single outputs)")
    output.args = (tuple(outs) + tuple(nodes[name] for name in node_names),)
    tapped.recompile()
    return tapped


def without_extra_outputs(tapped: GraphModule, num_outputs: int) -> GraphModule:
    """Inverse of `with_extra_outputs` (for checking that taps add outputs and nothing else)."""
    plain, _ = copy_graph(tapped)
    output = next(n for n in reversed(plain.graph.nodes) if n.op == "output")
    output.args = (tuple(output.args[0][:num_outputs]),)
    plain.recompile()
    return plain


InputFault = Callable[[Piece, tuple[Any, ...]], tuple[Any, ...]]


class TapProbe(nn.Module):
    """Stands in for a piece in the split graph: runs it, records the tap outputs, returns the original outputs."""

    def __init__(self, piece: Piece, names: Sequence[str], num_outputs: int, recorder: TapRecorder) -> None:
        super().__init__()
        self.piece = piece
        self.names = list(names)
        self.num_outputs = num_outputs
        self.unwrap_single = not piece.returns_tuple  # the traced piece returned one tensor, not a tuple
        self.recorder = recorder
        self.input_fault: InputFault | None = None  # fault injection: rewrites the arguments of a launch

    def forward(self, *args: Any) -> Any:
        if self.input_fault is not None:
            args = self.input_fault(self.piece, args)
        out = self.piece(*args)
        for name, value in zip(self.names, out[self.num_outputs :], strict=True):
            self.recorder.record(name, value)
        return out[0] if self.unwrap_single else tuple(out[: self.num_outputs])
