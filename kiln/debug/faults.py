"""Fault injection, so users and tests can prove the debugger finds what it claims.

- `layer=K:mlp` (or `layer=K:attn`): a numerical fault in one module — its output scaled by (1 + 1e-2) — built
  into the *compiled code* of the piece holding it, as a miscompile would be (`GraphControls.rebuild`
  with `compiled_only=True`). Eager pieces and the eager reference stay correct, so `diff` sees the error start
  at that boundary and `bisect` finds the piece (it fails compiled and captured, passes eager). Identical pieces
  keep their own, correct compiled code.
- `piece=K:stale-input`: a capture fault — piece K's replays read the input its capture saw on its first replay
  at that size, as when a runner writes a new input somewhere other than the static buffer the graph reads
  (a `before` hook on the piece).
  Only captured launches are affected: the piece passes compiled and eager.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.fx import GraphModule

from kiln.compile.modes import PieceMode
from kiln.compile.piece import Piece
from kiln.debug.taps import copy_graph
from kiln.errors import ConfigError

if TYPE_CHECKING:
    from kiln.debug.session import DebugSession

LAYER_FAULT_SCALE = 1e-2
_SPEC = re.compile(r"^(layer|piece)=(\d+):([\w-]+)$")
_LAYER_PARTS = {"mlp": "mlp", "attn": "attn"}


@dataclass(frozen=True)
class Fault:
    kind: str  # "layer" | "piece"
    index: int
    what: str  # "mlp" | "attn" (layer faults), "stale-input" (piece faults)

    def __str__(self) -> str:
        return f"{self.kind}={self.index}:{self.what}"


def parse_fault(spec: str) -> Fault:
    match = _SPEC.match(spec.strip())
    if match is None:
        raise ConfigError(f"--inject-fault {spec!r}: expected layer=K:mlp, layer=K:attn or piece=K:stale-input")
    kind, index, what = match.group(1), int(match.group(2)), match.group(3)
    if kind == "layer" and what not in _LAYER_PARTS:
        raise ConfigError(f"--inject-fault {spec!r}: a layer fault goes into 'mlp' or 'attn', not {what!r}")
    if kind == "piece" and what != "stale-input":
        raise ConfigError(f"--inject-fault {spec!r}: the piece fault is 'stale-input', not {what!r}")
    return Fault(kind, index, what)


def inject(session: DebugSession, fault: Fault, scale: float = LAYER_FAULT_SCALE) -> str:
    """Apply `fault` to the session's graph path through the debugger's controls; a one-line description. A layer
    fault scales its module's output by (1 + scale): tests hold the debugger to faults far smaller than 1e-2."""
    controls = session.controls
    pieces = session.graph.pieces
    if fault.kind == "layer":
        num_layers = len(session.model.model.layers)
        if not 0 <= fault.index < num_layers:
            raise ConfigError(f"--inject-fault {fault}: the model has layers 0..{num_layers - 1}")
        stage = getattr(session.model, "stage", None)
        if stage is not None and not stage.holds_layer(fault.index):  # a multi-device debug run (kiln.debug.ranks)
            return f"{fault}: layer {fault.index} runs on another pipeline stage: nothing injected on this rank"
        boundary = session.boundary(f"layers.{fault.index}.{_LAYER_PARTS[fault.what]}")
        assert boundary.piece is not None
        node = session.tap_nodes[boundary.name]
        target = boundary.piece
        controls.rebuild(
            lambda p: perturbed_graph(p.graph, node, scale) if p.index == target else None,
            compiled_only=True,
        )
        text = f"{fault}: {boundary.module_path} output x(1+{scale:g}) in piece {target}'s compiled code"
    else:
        if not 0 <= fault.index < len(pieces):
            raise ConfigError(f"--inject-fault {fault}: the graph has pieces 0..{len(pieces) - 1}")
        controls.set_piece_hooks(fault.index, before=StaleInput(), after=session.probes[fault.index])
        text = f"{fault}: piece {fault.index} ({pieces[fault.index].describe()}) replays a stale input buffer"
    session.fault_descriptions.append(text)
    return text


def perturbed_graph(graph: GraphModule, node_name: str, scale: float) -> GraphModule:
    """A copy of `graph` in which node `node_name`'s value is multiplied by (1 + scale) for all its users."""
    faulty, nodes = copy_graph(graph)
    node = nodes[node_name]
    with faulty.graph.inserting_after(node):
        scaled = faulty.graph.call_function(operator.mul, (node, 1.0 + scale))
    scaled.meta = dict(node.meta)
    node.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)
    faulty.recompile()
    return faulty


class StaleInput:
    """Rewrites a captured launch's first activation input to what that capture saw on its first replay."""

    def __init__(self) -> None:
        self.first_seen: dict[int, torch.Tensor] = {}

    def __call__(self, piece: Piece, args: tuple[Any, ...]) -> tuple[Any, ...]:
        n = piece.num_tokens(args)
        if piece.mode is not PieceMode.CAPTURED or n not in piece.captures:
            return args
        i = piece.dynamic_args[0]
        if n not in self.first_seen:
            self.first_seen[n] = args[i].clone()
            return args
        return (*args[:i], self.first_seen[n], *args[i + 1 :])
