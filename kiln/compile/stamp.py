"""Trace three decoder layers, stamp the rest: the traced forward of a uniform decoder stack without tracing it all.

Dynamo's trace is most of a warm start (two traces of the default model's 30 layers, ~9 s each on 2 cores), and
it is the same work 30 times: in a stack whose layers are alike (the same module types, attributes and weight
shapes, only `layer_idx` differing: kiln.compile.layer_signature) every layer traces to the same nodes. So the
forward is traced through its first three layers only (the decoder's `tracing_layers`, kiln.model.llama) and each
further layer is a copy of the third's nodes:
- a reference to the previous layer's node (the residual stream) becomes the same node of the copy before it;
  the second layer's nodes line up one for one with the third's (checked), so the first copy can follow the third;
- a reference to an earlier node (the embedding, values computed once in the first layer) stays as it is;
- a placeholder of the third layer's weights becomes the same attribute of the copy's layer (a weight the layers
  share, as the rotary tables, stays one placeholder), its KV cache the copy's, the attention op's layer index
  the copy's; per-step inputs and symbols stay;
- module paths (`model.layers.2.mlp` -> `model.layers.17.mlp`) are rewritten, so pieces, layer units, taps and
  the debugger see the layer each node belongs to.
The nodes after the last layer (the final norm) follow the last copy. Node names differ from a full trace; the
structure does not (`kiln.compile.split.structure_key` is name-blind, so compiled pieces and their cache entries
are the same; tests compare the two graphs node by node). A stack that is not uniform, or whose trace does not
line up, is traced whole (`stamp_layers` returns None and says why at debug level).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from functools import cached_property
from typing import Any

import torch
from torch import nn
from torch.fx import Graph, GraphModule, Node

from kiln.compile.backend import TracedForward, trace_forward
from kiln.compile.decode_units import layer_index
from kiln.compile.layer_signature import TEMPLATE_LAYERS, describe, stampable_layers

logger = logging.getLogger("kiln")

LAYER_INDEX_ARG = {torch.ops.kiln.attention: 3, torch.ops.kiln.attention.default: 3}  # args that are layer_idx


def trace_model(
    model: nn.Module, kv_caches: list[torch.Tensor], device: torch.device, sample_size: int = 8, **options: Any
) -> TracedForward:
    """`trace_forward` of the model's forward (`options` as there): through three layers and the rest stamped
    where the stack is uniform, else whole."""
    layers = stampable_layers(model)
    if layers:
        with model.model.tracing_layers(layers[:TEMPLATE_LAYERS]):
            traced = trace_forward(
                forward=model, model=model, kv_caches=kv_caches, device=device, sample_size=sample_size, **options
            )
        start = time.perf_counter()
        stamped = stamp_layers(traced, model, kv_caches, layers)
        if stamped is not None:
            logger.info(
                "Stamped layers %d-%d from layer %d in %.2f s (%d nodes)",
                layers[TEMPLATE_LAYERS],
                layers[-1],
                layers[TEMPLATE_LAYERS - 1],
                time.perf_counter() - start,
                len(stamped.gm.graph.nodes),
            )
            return stamped
    return trace_forward(
        forward=model, model=model, kv_caches=kv_caches, device=device, sample_size=sample_size, **options
    )


def stamp_layers(
    traced: TracedForward, model: nn.Module, kv_caches: list[torch.Tensor], layers: list[int]
) -> TracedForward | None:
    """The traced forward of every layer in `layers` from `traced`, a trace through the first three (None: it
    does not line up; trace the whole forward)."""
    try:
        return _Stamper(traced, model, kv_caches, layers).stamp()
    except _NotStampable as exc:
        logger.debug("Tracing every layer: the first %d do not stamp the rest (%s)", TEMPLATE_LAYERS, exc)
        return None


class _NotStampable(Exception):
    pass


class _Stamper:
    def __init__(
        self, traced: TracedForward, model: nn.Module, kv_caches: list[torch.Tensor], layers: list[int]
    ) -> None:
        self.traced, self.kv_caches = traced, kv_caches
        self.decoder_layers = model.model.layers
        self.first, self.prev, self.template = layers[:TEMPLATE_LAYERS]
        self.copies = layers[TEMPLATE_LAYERS:]
        nodes = list(traced.gm.graph.nodes)
        self.placeholders = [n for n in nodes if n.op == "placeholder"]
        self.output = nodes[-1]
        self.ops = [n for n in nodes if n.op not in ("placeholder", "output")]
        self.layer_of = {n: layer_index(n) for n in self.ops}
        self.bound = dict(zip(self.placeholders, traced.bound, strict=True))
        self.slot = dict(zip(self.placeholders, traced.slots, strict=True))
        self.tensor_paths = _tensor_paths(self.decoder_layers[self.template])

    def stamp(self) -> TracedForward:
        prev, template = self._lined_up_layers()
        position = {n: i for i, n in enumerate(prev)}
        suffix_start = self.ops.index(template[-1]) + 1
        graph = Graph()
        env, new_placeholders, slots, bound = self._placeholders(graph, template, suffix_start)
        for n in self.ops[:suffix_start]:
            env[n] = graph.node_copy(n, lambda a: env[a])
        last = [env[n] for n in template]
        for layer in self.copies:
            copy: dict[Node, Node] = {}

            def ref(a: Node, layer: int = layer, copy: dict[Node, Node] = copy, before: list[Node] = last) -> Node:
                if a in copy:
                    return copy[a]
                if a in position:
                    return before[position[a]]
                if (layer, a) in new_placeholders:
                    return new_placeholders[layer, a]
                return env[a]

            for n in template:
                copy[n] = node = graph.node_copy(n, ref)
                node.args = _renamed_in_messages(n, self._layer_args(n, node.args, layer), ref)
                node.meta = _moved_meta(n.meta, self.template, layer)
            last = [copy[n] for n in template]
        final = dict(zip(template, last, strict=True))

        def after(a: Node) -> Node:
            if a in position:
                raise _NotStampable(f"the nodes after the layers read layer {self.prev}'s {a.name}")
            return final.get(a) or env[a]

        for n in self.ops[suffix_start:]:
            env[n] = graph.node_copy(n, after)
        graph.output(torch.fx.map_arg(self.output.args[0], after))
        gm = GraphModule(self.traced.gm, graph)
        gm.meta = dict(self.traced.gm.meta)
        return TracedForward(gm, slots, bound, self.traced.trace_s)

    def _lined_up_layers(self) -> tuple[list[Node], list[Node]]:
        """The second and third layers' nodes, checked: the layers run one after the other, and the second's
        nodes are the third's one for one (so a copy can follow the third as the third follows the second)."""
        order = [self.layer_of[n] for n in self.ops]
        traced_layers = [self.first, self.prev, self.template]
        runs = [layer for i, layer in enumerate(order) if i == 0 or layer != order[i - 1]]
        if [r for r in runs if r is not None] != traced_layers or runs.count(None) > 2:
            raise _NotStampable(f"the trace's layers run in the order {runs}, expected {traced_layers}")
        prev = [n for n in self.ops if self.layer_of[n] == self.prev]
        template = [n for n in self.ops if self.layer_of[n] == self.template]
        if [_op(n) for n in prev] != [_op(n) for n in template]:
            raise _NotStampable("the second and third layers trace to different nodes")
        return prev, template

    def _placeholders(
        self, graph: Graph, template: list[Node], suffix_start: int
    ) -> tuple[dict[Node, Node], dict[tuple[int, Node], Node], list[str | None], list[Any]]:
        """The new graph's placeholders in a full trace's order: those met up to the third layer, the copies'
        own (layer by layer), then those first met after the layers; with their slots and bound values."""
        env: dict[Node, Node] = {}
        slots: list[str | None] = []
        bound: list[Any] = []
        before = set(self.ops[:suffix_start])
        after = [p for p in self.placeholders if p.users and not any(u in before for u in p.users)]
        for p in [p for p in self.placeholders if p not in after]:
            env[p] = graph.node_copy(p)
            slots.append(self.slot[p])
            bound.append(self.bound[p])
        new_placeholders: dict[tuple[int, Node], Node] = {}
        names = {p.target for p in self.placeholders}
        # where dynamo's placeholder names hold the layer: its weights' paths, its KV cache's index
        layer_in_name = re.compile(rf"(_layers_modules_|_kv_caches_){self.template}_")
        for (layer, p), value in self._placeholders_of_copies(set(template)).items():
            name = layer_in_name.sub(rf"\g<1>{layer}_", p.target)
            while name in names:  # a placeholder's target is its argument's name: it must be unique
                name += "_"
            names.add(name)
            new_placeholders[layer, p] = node = graph.placeholder(name)
            node.meta = dict(p.meta)
            slots.append(None)
            bound.append(value)
        for p in after:
            env[p] = graph.node_copy(p)
            slots.append(self.slot[p])
            bound.append(self.bound[p])
        return env, new_placeholders, slots, bound

    def _placeholders_of_copies(self, template: set[Node]) -> dict[tuple[int, Node], torch.Tensor]:
        """Each copy's value for every bound placeholder of the template layer that is the layer's own (its weight
        or KV cache); a placeholder the layers share maps to itself (absent here)."""
        inputs = [p for p in self.placeholders if any(u in template for u in p.users) and self.slot[p] is None]
        values: dict[tuple[int, Node], torch.Tensor] = {}
        for layer in self.copies:  # in the order a full trace meets them: layer by layer, each in first use
            for p in inputs:
                mine = self._value_in_layer(self.bound[p], layer)
                if mine is not self.bound[p]:
                    values[layer, p] = mine
        return values

    def _value_in_layer(self, value: torch.Tensor, layer: int) -> torch.Tensor:
        for i, cache in enumerate(self.kv_caches):
            if cache is value:
                if i != self.template:
                    raise _NotStampable(f"layer {self.template} reads KV cache {i}")
                return self.kv_caches[layer]
        path = self.tensor_paths.get(id(value))
        if path is None:
            if id(value) in self._layers_tensors:
                raise _NotStampable(f"layer {self.template} reads another layer's tensor")
            return value  # no layer's tensor (an input of the whole model)
        module_path, _, attr = path.rpartition(".")
        owner = self.decoder_layers[layer].get_submodule(module_path) if module_path else self.decoder_layers[layer]
        mine = getattr(owner, attr)
        if not isinstance(mine, torch.Tensor) or describe(mine) != describe(value):
            raise _NotStampable(f"layer {layer}'s {path} is not like layer {self.template}'s")
        return mine

    @cached_property
    def _layers_tensors(self) -> set[int]:
        """Every tensor any layer holds, by id."""
        return {i for layer in self.decoder_layers for i in _tensor_paths(layer)}

    def _layer_args(self, template: Node, args: tuple[Any, ...], layer: int) -> tuple[Any, ...]:
        i = LAYER_INDEX_ARG.get(template.target) if template.op == "call_function" else None
        if i is None:
            return args
        if args[i] != self.template:
            raise _NotStampable(f"{template.name} has layer index {args[i]}, expected {self.template}")
        return (*args[:i], layer, *args[i + 1 :])


def _renamed_in_messages(template: Node, args: tuple[Any, ...], ref: Callable[[Node], Node]) -> tuple[Any, ...]:
    """A runtime assertion's message names the node it checks ("... on node 'eq_4'"): the copy's node."""
    inputs = template.all_input_nodes
    if not inputs or not any(isinstance(a, str) for a in args):
        return args
    renamed = []
    for a in args:
        for node in inputs if isinstance(a, str) else ():
            a = a.replace(f"'{node.name}'", f"'{ref(node).name}'")
        renamed.append(a)
    return tuple(renamed)


def _op(node: Node) -> tuple[str, Any]:
    return node.op, node.target


def _tensor_paths(layer: nn.Module) -> dict[int, str]:
    """Every tensor a layer holds (parameters, buffers, tensor attributes) by id: its path inside the layer."""
    paths: dict[int, str] = {}
    for name, module in layer.named_modules(remove_duplicate=False):
        prefix = f"{name}." if name else ""
        for attr, value in (*module._parameters.items(), *module._buffers.items(), *vars(module).items()):
            if isinstance(value, torch.Tensor):
                paths.setdefault(id(value), prefix + attr)
    return paths


def _moved_meta(meta: dict[str, Any], template: int, layer: int) -> dict[str, Any]:
    """A copy's node meta: module paths of the template layer moved to `layer` (the rest shared)."""
    stack = meta.get("nn_module_stack")
    if not stack:
        return dict(meta)
    pattern = re.compile(rf"(layers(?:\.|\[)){template}(?=[\].]|$)")
    moved = {
        pattern.sub(rf"\g<1>{layer}", key): (pattern.sub(rf"\g<1>{layer}", path), cls)
        for key, (path, cls) in stack.items()
    }
    return {**meta, "nn_module_stack": moved}
