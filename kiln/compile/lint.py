"""Find graph nodes that become needless kernels or copies: dead getitem/contiguous/clone/copies, no-op casts.

Each finding names the piece, the model module path and the op, so the fix can go into the model code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from kiln.compile.split import node_module_path, op_name

_COPY_OPS = {"contiguous", "clone", "copy", "copy_", "to", "float", "half", "bfloat16", "type_as", "getitem"}


@dataclass
class LintFinding:
    piece: int
    node: str
    op: str
    module_path: str
    problem: str

    def line(self) -> str:
        where = self.module_path or "<top level>"
        return f"piece {self.piece}: {self.node} = {self.op} in {where}: {self.problem}"


def lint_graph(piece_index: int, graph: GraphModule) -> list[LintFinding]:
    findings = []
    for node in graph.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        op = op_name(node.target).rsplit(".", 1)[-1]
        if op not in _COPY_OPS:
            continue
        problem = _problem(node, op)
        if problem:
            findings.append(
                LintFinding(
                    piece=piece_index, node=node.name, op=op, module_path=node_module_path(node), problem=problem
                )
            )
    return findings


def _problem(node: Node, op: str) -> str:
    if not node.users:
        return "dead: its result is never used (a kernel or copy for nothing)"
    src = node.args[0] if node.args and isinstance(node.args[0], Node) else None
    value, src_value = node.meta.get("example_value"), src.meta.get("example_value") if src is not None else None
    if not isinstance(value, torch.Tensor) or not isinstance(src_value, torch.Tensor):
        return ""
    if op == "contiguous" and src_value.is_contiguous():
        return "no-op: the input is already contiguous"
    if op in ("to", "float", "half", "bfloat16", "type_as") and value.dtype == src_value.dtype:
        return f"no-op cast: the input is already {str(value.dtype).removeprefix('torch.')}"
    if op == "clone" and all(u.op != "call_method" or not str(u.target).endswith("_") for u in node.users):
        return "copy never mutated: the clone can go"
    return ""
