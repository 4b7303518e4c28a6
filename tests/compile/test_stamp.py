"""Layers stamped from a three-layer trace (kiln.compile.stamp) against dynamo's trace of every layer."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.fx import Node

from kiln.compile.backend import TracedForward, trace_forward
from kiln.compile.layer_signature import stampable_layers
from kiln.compile.split import node_module_path, structure_key
from kiln.compile.stamp import trace_model
from kiln.model.forward_context import ForwardContext, set_forward_context
from tests.compile.tiny import make_runner, prefill_metadata, tiny_model

LAYERS = 6
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model_and_caches() -> tuple[torch.nn.Module, list[torch.Tensor]]:
    model = tiny_model(num_layers=LAYERS)
    return model, make_runner(model).kv_caches


def canonical(traced: TracedForward) -> list[tuple[Any, ...]]:
    """Every node but placeholders as (op, target, args, kwargs, module path): a node argument by its position, a
    placeholder by its per-step slot or the identity of the tensor bound to it (which layer's weight, which cache)."""
    placeholders = [n for n in traced.gm.graph.nodes if n.op == "placeholder"]
    value = {p: slot or id(bound) for p, slot, bound in zip(placeholders, traced.slots, traced.bound, strict=True)}
    index: dict[Node, int] = {}

    def ref(a: object) -> object:
        if isinstance(a, Node):
            return ("input", value[a]) if a.op == "placeholder" else ("node", index[a])
        if isinstance(a, (list, tuple)):
            return tuple(ref(x) for x in a)
        if isinstance(a, dict):
            return {k: ref(v) for k, v in a.items()}
        return repr(a)

    nodes = []
    for node in traced.gm.graph.nodes:
        if node.op != "placeholder":
            index[node] = len(index)
            nodes.append((node.op, str(node.target), ref(node.args), ref(node.kwargs), node_module_path(node)))
    return nodes


@pytest.mark.parametrize("decode", [False, True], ids=["piecewise", "decode"])
def test_stamped_layers_are_the_full_trace_node_for_node(model_and_caches, decode: bool):
    model, caches = model_and_caches
    assert stampable_layers(model) == list(range(LAYERS))
    whole = trace_forward(model, model, caches, CPU, 8, decode=decode)
    stamped = trace_model(model, caches, CPU, 8, decode=decode)
    assert len(stamped.gm.graph.nodes) == len(whole.gm.graph.nodes)
    assert canonical(stamped) == canonical(whole)
    assert structure_key(stamped.gm) == structure_key(whole.gm)
    assert stamped.slots == whole.slots
    # the copies' weights are their own layer's, in the order a full trace binds them
    assert [id(b) for b in stamped.bound] == [id(b) for b in whole.bound]
    last = {node_module_path(n) for n in stamped.gm.graph.nodes}
    assert f"model.layers.{LAYERS - 1}.mlp.down_proj" in last
    stamped.gm.graph.lint()


def test_stamped_forward_computes_what_the_model_does(model_and_caches):
    model, caches = model_and_caches
    stamped = trace_model(model, caches, CPU, 8)
    ids = torch.randint(0, 128, (5,))
    positions = torch.arange(5)
    ctx = ForwardContext(prefill_metadata(5), caches)
    with torch.inference_mode(), set_forward_context(ctx):
        expected = model(ids, positions)
    with torch.inference_mode(), set_forward_context(ForwardContext(prefill_metadata(5), caches)):
        got = stamped.gm(*stamped.args_for({"input_ids": ids, "positions": positions, "num_tokens": 5}))
    torch.testing.assert_close(got[0] if isinstance(got, (tuple, list)) else got, expected)


def test_a_stack_whose_layers_differ_is_traced_whole():
    model = tiny_model(num_layers=LAYERS)
    model.model.layers[4].self_attn.window = 8  # one sliding layer: it traces to other nodes
    assert stampable_layers(model) is None
    caches = make_runner(model).kv_caches
    traced = trace_model(model, caches, CPU, 8)
    assert canonical(traced) == canonical(trace_forward(model, model, caches, CPU, 8))


def test_three_layers_or_fewer_are_traced_whole():
    assert stampable_layers(tiny_model(num_layers=3)) is None
