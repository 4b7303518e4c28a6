"""Split a traced forward at the splitting ops (attention) into pieces, and name what each piece is.

With N splitting-op calls the forward becomes 2N+1 submodules: N+1 pieces (compiled and captured) and N
splitting submodules (run eagerly: attention reads per-step metadata Python-side). Structurally identical
pieces (every middle layer) share one `structure_key`, so they compile once.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.split_module import split_module

_SYMBOL = re.compile(r"\b[su]\d+\b")
_NODE_NAME = re.compile(r"on node '\w+'")  # a runtime assertion's message names its node: not structure


@dataclass
class SplitPiece:
    index: int  # piece index (0..N): what --piece-modes and the artifacts count
    submod_name: str  # attribute of the split module that runs it
    graph: GraphModule
    structure_key: str  # equal for pieces with the same code up to parameter names
    module_paths: list[str]  # model modules whose ops this piece holds, in order


@dataclass
class SplitForward:
    split_gm: GraphModule  # the outer graph: calls submod_0, submod_1, ... in order
    pieces: list[SplitPiece]
    splitting_submods: list[str]


def op_name(target: object) -> str:
    """`kiln.attention` for torch.ops.kiln.attention (packet or `.default` overload), else the target's name."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target).removesuffix(".default")
    if isinstance(target, torch._ops.OpOverloadPacket):
        return str(target)
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)
    return f"{module}.{name}" if module else name


def is_splitting_node(node: Node, splitting_ops: tuple[str, ...]) -> bool:
    return node.op == "call_function" and op_name(node.target) in splitting_ops


def split_graph(gm: GraphModule, splitting_ops: tuple[str, ...]) -> SplitForward:
    """Cut `gm` before and after every splitting op; raise ValueError if none is found."""
    subgraph_of: dict[Node, int] = {}
    current = 0
    num_splits = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_splitting_node(node, splitting_ops):
            subgraph_of[node] = current + 1
            current += 2
            num_splits += 1
        else:
            subgraph_of[node] = current
    if num_splits == 0:
        raise ValueError(f"the traced forward calls none of the splitting ops {list(splitting_ops)}")
    split_gm = split_module(gm, None, lambda n: subgraph_of[n], keep_original_order=True)
    pieces: list[SplitPiece] = []
    splitting: list[str] = []
    for node in split_gm.graph.nodes:
        if node.op != "call_module":
            continue
        sub = getattr(split_gm, node.target)
        if any(is_splitting_node(n, splitting_ops) for n in sub.graph.nodes):
            splitting.append(node.target)
            continue
        pieces.append(
            SplitPiece(
                index=len(pieces),
                submod_name=node.target,
                graph=sub,
                structure_key=structure_key(sub),
                module_paths=module_paths(sub),
            )
        )
    return SplitForward(split_gm, pieces, splitting)


def node_module_path(node: Node) -> str:
    """The model module an FX node came from (`model.layers.3.mlp.down_proj`), or '' for top-level code."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return _clean_path(path)


def _clean_path(path: str) -> str:
    # dynamo writes "L['self'].model.layers.0.mlp" (and "L['self'].model.layers[0]" in some versions)
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    return path.removeprefix("self.").strip(".")


def module_paths(gm: GraphModule) -> list[str]:
    seen: dict[str, None] = {}
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            path = node_module_path(node)
            if path:
                seen.setdefault(path, None)
    return list(seen)


def structure_key(gm: GraphModule) -> str:
    """A hash of the graph's ops, wiring, constants and input shapes, blind to node and parameter names."""
    index: dict[Node, int] = {}
    lines: list[str] = []

    def ref(a: object) -> object:
        if isinstance(a, Node):
            return f"%{index[a]}"
        if isinstance(a, (list, tuple)):
            return type(a)(ref(x) for x in a)
        if isinstance(a, dict):
            return {k: ref(v) for k, v in a.items()}
        if isinstance(a, slice):
            return f"slice({ref(a.start)},{ref(a.stop)},{ref(a.step)})"
        return _SYMBOL.sub("s", _NODE_NAME.sub("on node", repr(a)))

    for node in gm.graph.nodes:
        index[node] = len(index)
        target = op_name(node.target) if node.op != "placeholder" else ""
        lines.append(
            f"{node.op}|{target}|{ref(node.args)}|{ref(node.kwargs)}|{_describe(node.meta.get('example_value'))}"
        )
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:20]


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        shape = ",".join(_SYMBOL.sub("s", str(d)) for d in value.shape)
        stride = ",".join(_SYMBOL.sub("s", str(d)) for d in value.stride())
        return f"{value.dtype}[{shape}]/[{stride}]"
    if isinstance(value, (tuple, list)):
        return "(" + ";".join(_describe(v) for v in value) + ")"
    if isinstance(value, torch.SymInt):
        return "sym"
    return type(value).__name__
