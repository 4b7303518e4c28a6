"""Where a recipe fusion group sits in the piece graphs: one instance of it, as FX nodes per op.

Ops are matched inside one decoder layer (`model.layers.N`, together with the model's top-level modules):
- a module op names the nodes of the modules with that name; kiln's merged modules count for their parts
  (`gate_proj` and `up_proj` match `gate_up_proj`, `q_proj` matches `qkv_proj`);
- `rms_norm` and `rotary_emb` name the nodes of an RMSNorm or a rotary-embedding module (where a layer's graph holds
  several, the one that reads or feeds the group's other ops);
- any other op (`silu`, `mul`, `add`) names the nodes of that kind computed directly in the parent of a matched
  module (the MLP for `gate_proj`, the decoder layer for `rms_norm`); in a group of such ops only, in the module
  that computes the group's first op other than `mul` and `add` (the MLP for `[silu, mul]`).
The instance is the (layer, piece) that matches most ops, preferring pieces with generated code, then the earliest;
an op that only another piece of that layer holds is reported with that piece. A "piece" here is any `CheckedCode`:
a graph piece, or a layer unit of the full decode graph (kiln.compile.full_graph).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from torch.fx import GraphModule, Node

from kiln.compile.split import node_module_path, op_name

_LAYER = re.compile(r"^(.*?\blayers\.\d+)(?:\.|$)")
_COMMON = ("mul", "add")  # kinds found in every module; they cannot place a group alone
# functional ops that name a kind of module rather than one op: (module path, class name) -> in it
_MODULE_KINDS: dict[str, Callable[[str, str], bool]] = {
    "rms_norm": lambda path, cls: cls.endswith("RMSNorm"),
    "rotary_emb": lambda path, cls: path.rsplit(".", 1)[-1] == "rotary_emb",
}


@dataclass(frozen=True, eq=False)
class CheckedCode:
    """One graph and the code compiled from it, as the fusion check reads them: a piece, or a layer unit of the full
    decode graph."""

    index: int
    label: str  # how reports name it: `piece 3`, `full decode graph, layer unit 2/30`
    graph: GraphModule  # what the code was compiled from
    source: str | None  # the generated code for any num_tokens; None: none (the eager compiler, an eager mode)
    mode: str
    static_sources: dict[int, str] = field(default_factory=dict)  # num_tokens -> the code compiled for it alone


@dataclass
class GroupInstance:
    piece: CheckedCode | None  # None: no op of the group is in the graph
    scope: str = ""  # the module holding the instance (`model.layers.0.mlp`)
    nodes: dict[str, list[Node]] = field(default_factory=dict)  # op -> its nodes in `piece`
    modules: set[str] = field(default_factory=set)  # ops matched as modules (every node of theirs counts)
    elsewhere: dict[str, int] = field(default_factory=dict)  # op -> the piece of the same layer that holds it


@dataclass(frozen=True)
class _Entry:
    layer: str  # `model.layers.3`, or "" for the model's top-level modules
    path: str
    cls: str
    node: Node


def locate(pieces: list[CheckedCode], ops: tuple[str, ...], has_code: Callable[[CheckedCode], bool]) -> GroupInstance:
    """The instance of the group `ops` (the rules above); `has_code(piece)` prefers pieces with generated code."""
    entries = {p.index: _entries(p) for p in pieces}
    leaves = {e.path.rsplit(".", 1)[-1] for es in entries.values() for e in es}
    modules = {op for op in ops if op in _MODULE_KINDS or any(module_matches(op, leaf) for leaf in leaves)}

    def match(piece: CheckedCode, layer: str) -> tuple[dict[str, list[Node]], list[str]]:
        return _match([e for e in entries[piece.index] if e.layer in (layer, "")], ops, modules)

    candidates = [(p, layer) for p in pieces for layer in dict.fromkeys(e.layer for e in entries[p.index])]
    if not candidates:
        return GroupInstance(None)
    piece, layer = max(candidates, key=lambda c: (len(match(*c)[0]), has_code(c[0])))  # the first of the best
    found, homes = match(piece, layer)
    if not found:
        return GroupInstance(None)
    elsewhere = {}
    for op in (op for op in ops if op not in found):
        other = next((p for p in pieces if p is not piece and op in match(p, layer)[0]), None)
        if other is not None:
            elsewhere[op] = other.index
    return GroupInstance(
        piece, scope=_common_prefix(homes), nodes=found, modules=modules & set(found), elsewhere=elsewhere
    )


def module_matches(op: str, leaf: str) -> bool:
    """`gate_proj` matches `gate_proj` and the fused `gate_up_proj`; `q_proj` matches `qkv_proj`."""
    op = op.rsplit(".", 1)[-1]
    if op == leaf:
        return True
    if not (op.endswith("_proj") and leaf.endswith("_proj")):
        return False
    stem, fused = op.removesuffix("_proj"), leaf.removesuffix("_proj")
    return stem in fused.split("_") or (len(stem) == 1 and "_" not in fused and stem in fused)


def node_kind(node: Node) -> str:
    """A short op name: silu, mul, linear, add, ..."""
    name = op_name(node.target).rsplit(".", 1)[-1]
    return {"__mul__": "mul", "__add__": "add", "truediv": "div"}.get(name, name)


def _match(entries: list[_Entry], ops: tuple[str, ...], modules: set[str]) -> tuple[dict[str, list[Node]], list[str]]:
    """({op: nodes} for the ops found in `entries`, the modules the plain ops are looked for in)."""
    found: dict[str, list[Node]] = {}
    homes: list[str] = []
    for op in ops:
        if op in modules:
            hits = [e for e in entries if _in_module(op, e)]
            if hits:
                found[op] = [e.node for e in hits]
                homes += [e.path.rsplit(".", 1)[0] for e in hits]
    plain = [op for op in ops if op not in modules]
    if plain and not homes:
        anchor = next((op for op in plain if op not in _COMMON), plain[0])
        homes = [e.path for e in entries if node_kind(e.node) == anchor][:1]
    for op in plain:
        hits = [e.node for e in entries if node_kind(e.node) == op and e.path in homes]
        if hits:
            found[op] = hits
    for op in (op for op in found if op in _MODULE_KINDS):
        others = {n for other, nodes in found.items() if other != op for n in nodes}
        found[op] = _one_module(found[op], others)
    return {op: found[op] for op in ops if op in found}, list(dict.fromkeys(homes))


def _one_module(nodes: list[Node], others: set[Node]) -> list[Node]:
    """The nodes of one module of a kind (`rms_norm`): a graph holding a whole decoder layer (the full decode graph's
    layer units) has two RMSNorms, or three beside the final norm; the group means the one that reads or feeds a
    node of its other ops (the first such, else the first)."""
    modules: dict[str, list[Node]] = {}
    for node in nodes:
        modules.setdefault(node_module_path(node), []).append(node)
    if len(modules) < 2:
        return nodes
    touching = [ns for ns in modules.values() if any(m in others for n in ns for m in (*n.all_input_nodes, *n.users))]
    return (touching or list(modules.values()))[0]


def _in_module(op: str, entry: _Entry) -> bool:
    if op in _MODULE_KINDS:
        return _MODULE_KINDS[op](entry.path, entry.cls)
    return module_matches(op, entry.path.rsplit(".", 1)[-1])


def _entries(piece: CheckedCode) -> list[_Entry]:
    out = []
    for node in piece.graph.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        path = node_module_path(node)
        stack = node.meta.get("nn_module_stack") or {}
        cls = list(stack.values())[-1][1] if stack else ""
        layer = _LAYER.match(path)
        out.append(_Entry(layer.group(1) if layer else "", path, getattr(cls, "__name__", str(cls)), node))
    return out


def _common_prefix(paths: list[str]) -> str:
    if not paths:
        return ""
    parts = [p.split(".") for p in paths]
    common = []
    for names in zip(*parts, strict=False):
        if len(set(names)) > 1:
            break
        common.append(names[0])
    return ".".join(common)
