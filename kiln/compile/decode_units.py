"""The full decode graph compiled in layer units: one compile per distinct decoder layer, not per model.

A whole-model compile of the traced decode forward costs minutes on 2 cores (every layer inlined into one
inductor graph: 30 copies of the same code to schedule, fuse and build). The graph is cut at decoder-layer
boundaries instead (the layer of each node comes from its module path, `model.layers.17.mlp`): the nodes before
the first layer (embedding, decode positions) join the first unit and those after the last (final norm) the
last, so a model has as many units as layers and, for a uniform stack, three distinct ones (first, middle,
last), each compiled once through the compiled-piece store and shared by every structurally identical layer, as
identical pieces are. The result runs the units in order from one FX module: same inputs and outputs as the
whole graph, and on CUDA it is captured as one CUDA graph all the same (capture records kernels, not calls).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node
from torch.fx.passes.split_module import split_module

from kiln.compile.compiler import CompiledPiece, make_tuple_output
from kiln.compile.split import module_paths, node_module_path, structure_key
from kiln.compile.store import CompiledPieceStore
from kiln.compile.verify import probe_inputs

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def layer_index(node: Node) -> int | None:
    """The decoder layer a node belongs to (`model.layers.17.self_attn.qkv_proj` -> 17), None outside layers."""
    match = _LAYER.search(node_module_path(node))
    return int(match.group(1)) if match else None


def unit_assignment(gm: GraphModule) -> dict[Node, int]:
    """Unit of every node: the rank of its layer among the graph's layers in order (a pipeline stage's layers need
    not start at 0); nodes outside layers stay with the unit before them, those before the first with the first.
    Units never decrease along the graph's node order, so every value flows from a unit to a later one."""
    order: dict[int, int] = {}
    units: dict[Node, int] = {}
    current = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        layer = layer_index(node)
        if layer is not None:
            rank = order.setdefault(layer, len(order))
            current = max(current, rank)
        units[node] = current
    return units


def unit_store_key(structure: str) -> str:
    """What the compiled-piece store (its memo, cache and compile times) files a unit of this structure under."""
    return f"decode_unit:{structure}"


class _Unit(nn.Module):
    """A unit in the split module's place: runs `fn` (the unit's graph, then its compiled code), which returns a
    sequence, and gives the outer module what the unit's graph returned before (one value or a tuple)."""

    def __init__(self, fn: Callable[..., Sequence[torch.Tensor]], single: bool) -> None:
        super().__init__()
        self.fn, self.single = fn, single

    def forward(self, *args: Any) -> Any:
        out = self.fn(*args)
        return out[0] if self.single else tuple(out)


class LayerUnits:
    """The decode graph `gm` split into layer units: `units` (submodule name, graph returning a tuple) in order,
    `outer` the module that calls them (eagerly until `compile`), and once compiled `sources`, each unit's generated
    code (None where the compiler generates none): what the fusion check and the artifacts read."""

    def __init__(self, gm: GraphModule) -> None:
        units = unit_assignment(gm)
        self.whole = gm
        self.outer = split_module(gm, None, lambda n: units[n], keep_original_order=True)
        self.units: list[tuple[str, GraphModule]] = []
        for node in self.outer.graph.nodes:
            if node.op == "call_module":
                sub = getattr(self.outer, node.target)
                single = not make_tuple_output(sub)  # every compiler sees (and returns) a sequence
                setattr(self.outer, node.target, _Unit(sub.forward, single))
                self.units.append((node.target, sub))
        self.keys = [structure_key(g) for _, g in self.units]  # what the store caches each unit under
        self.sources: list[str | None] = [None] * len(self.units)
        self._probes: dict[str, list[Any]] | None = None

    @property
    def distinct(self) -> int:
        return len(set(self.keys))

    def probes(self, device: torch.device) -> dict[str, list[Any]]:
        """Each unit's arguments in one eager run of the whole graph on a probe input: what a cached unit is
        checked on (a unit's own inputs are consistent only as the units before it make them)."""
        if self._probes is None:
            recorded: dict[str, list[Any]] = {}

            def record(unit: nn.Module, args: tuple[Any, ...]) -> None:
                recorded[names[unit]] = list(args)

            names = {getattr(self.outer, name): name for name, _ in self.units}
            hooks = [unit.register_forward_pre_hook(record) for unit in names]
            try:
                with torch.inference_mode():
                    self.outer(*probe_inputs(self.whole, device))
            finally:
                for hook in hooks:
                    hook.remove()
            self._probes = recorded
        return self._probes

    def compile(self, store: CompiledPieceStore, label: str, persistent: bool) -> CompiledPiece:
        """Every unit through `store` (once per structure), then the outer module over the compiled units."""
        sources: dict[str, str] = {}
        for i, ((name, graph), skey) in enumerate(zip(self.units, self.keys, strict=True)):
            paths = module_paths(graph)
            where = f"{paths[0]} .. {paths[-1]}" if len(paths) > 1 else (paths[0] if paths else "no module")
            unit_label = f"{label}, layer unit {i + 1}/{len(self.units)} ({where})"
            probe = lambda name=name: self.probes(store.device)[name]  # noqa: E731
            compiled = store.get(graph, unit_label, persistent=persistent, key=unit_store_key(skey), probe=probe)
            self.sources[i] = compiled.source_code
            if compiled.source_code:
                sources.setdefault(skey, compiled.source_code)
            getattr(self.outer, name).fn = compiled.fn
        # NOTE: the probe run's arguments hold a whole set of KV caches (probe inputs): kept, they doubled the
        # cache's memory for as long as the engine lived
        self._probes = None
        source = "\n".join(f"# layer unit {k}\n{s}" for k, s in sources.items()) or None
        return CompiledPiece(self.outer.forward, source)
