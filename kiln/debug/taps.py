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
- The session swaps the copies in through `GraphControls.rebuild` and hangs a `TapProbe` on each piece as its
  `after` hook (`GraphControls.set_piece_hooks`): it records the extra outputs; the piece itself returns only its
  original ones. Rewritten graphs are compiled outside the on-disk compile cache (the compiled-piece store's
  `persistent=False`), so the cache only ever holds production graphs.
- The `TapRecorder` is the engine's step observer (`ModelRunner`'s `StepObserver`): it opens a record per step,
  keeps the step's real input ids and positions, and the logits of the sampled row.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node

from kiln.compile.piece import Piece
from kiln.compile.split import node_module_path
from kiln.model.forward_context import ModelInputs, get_forward_context

LOGITS = "logits"


@dataclass(frozen=True)
class Boundary:
    name: str  # `embed`, `layers.3.attn`, `layers.3.mlp`, `norm`, `logits`
    module_path: str  # the model module whose output it is (`model.layers.3.mlp`); `lm_head` for logits
    piece: int | None = None  # the graph piece that computes it (None for logits: the head runs outside the graph)


def model_boundaries(model: nn.Module) -> list[Boundary]:
    """The boundaries of a Llama-family model, in the order the forward computes them; a pipeline stage's own (its
    layers, the embedding on the first, the final norm on the last, and the logits every rank is given)."""
    stage = getattr(model, "stage", None)
    layers = stage.layers if stage is not None and stage.layers is not None else range(len(model.model.layers))
    out = [Boundary("embed", "model.embed_tokens")] if stage is None or stage.is_first else []
    for k in layers:
        out.append(Boundary(f"layers.{k}.attn", f"model.layers.{k}.self_attn"))
        out.append(Boundary(f"layers.{k}.mlp", f"model.layers.{k}.mlp"))
    if stage is None or stage.is_last:
        out.append(Boundary("norm", "model.norm"))
    out.append(Boundary(LOGITS, "lm_head"))
    return out


@dataclass
class StepRecord:
    """One engine step as the taps saw it: the real tokens fed, and each boundary's rows."""

    input_ids: list[int]
    positions: list[int]
    values: dict[str, torch.Tensor]


class TapRecorder:
    """The engine's step observer: records boundary values per step, only between `begin_step` and `end_step`,
    so captures (which run on padding outside any step) record nothing."""

    def __init__(self) -> None:
        self.steps: list[StepRecord] = []
        self._active = False

    def begin_step(self, batch: ModelInputs) -> None:
        n = batch.metadata.num_actual_tokens
        self.steps.append(StepRecord(batch.input_ids[:n].tolist(), batch.positions[:n].tolist(), {}))
        self._active = True

    def end_step(self, logits: torch.Tensor | None) -> None:
        if logits is not None:  # one row per sampled token: a verification step's k + 1
            self.record(LOGITS, logits, rows=logits.shape[0])
        self._active = False

    def record(self, name: str, value: torch.Tensor, rows: int | None = None) -> None:
        """Keep a host copy of the first `rows` rows (the real tokens; the rest is capture padding)."""
        if not self._active:
            return
        if rows is None:
            rows = get_forward_context().attn_metadata.num_actual_tokens
        self.steps[-1].values[name] = value[:rows].detach().to("cpu", copy=True)

    def take(self) -> list[StepRecord]:
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
            parts = node_module_path(node).split(".")
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


class TapProbe:
    """A piece's `after` hook: records the tap outputs a rewritten piece graph returns after its own outputs."""

    def __init__(self, names: Sequence[str], num_outputs: int, recorder: TapRecorder) -> None:
        self.names = list(names)
        self.num_outputs = num_outputs
        self.recorder = recorder

    def __call__(self, piece: Piece, outputs: Sequence[torch.Tensor]) -> None:
        for name, value in zip(self.names, outputs[self.num_outputs :], strict=True):
            self.recorder.record(name, value)
