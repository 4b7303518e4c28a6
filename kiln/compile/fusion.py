"""Did each recipe fusion group end up in one kernel? If not, say which kernels and why.

A group names model modules (`gate_proj`, matched to kiln's fused `gate_up_proj` too) and functional ops
(`silu`, `mul`, matched inside the modules' common parent, e.g. `model.layers.0.mlp`). The first piece that
holds the group is inspected; identical pieces compile to the same code.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from torch.fx import Node

from kiln.compile.kernels import kernels_in
from kiln.compile.modes import PieceMode
from kiln.compile.split import node_module_path, op_name
from kiln.config import FusionGroupConfig

if TYPE_CHECKING:
    from kiln.compile.piece import Piece

logger = logging.getLogger("kiln")

_MATMULS = {"linear", "mm", "addmm", "bmm", "matmul"}


@dataclass
class FusionReport:
    name: str
    ops: list[str]
    realised: bool
    reason: str
    piece: int | None = None
    scope: str = ""
    kernels: list[str] = field(default_factory=list)


def fusion_reports(pieces: list[Piece], groups: tuple[FusionGroupConfig, ...], compiler: str) -> list[FusionReport]:
    reports = [_report(pieces, g, compiler) for g in groups]
    for r in reports:
        if r.realised:
            logger.info("Fusion applied: %s", r.name)
        else:
            logger.info("Fusion not applied: %s (%s)", r.name, r.reason)
    return reports


def as_json(reports: list[FusionReport]) -> list[dict]:
    return [asdict(r) for r in reports]


def _report(pieces: list[Piece], group: FusionGroupConfig, compiler: str) -> FusionReport:
    for piece in pieces:
        found = _match(piece, group)
        if found is None:
            continue
        scope, nodes = found
        missing = [op for op in group.ops if op not in nodes]
        base = FusionReport(group.name, list(group.ops), False, "", piece.index, scope)
        if missing:
            base.reason = f"ops {missing} not found in {scope}"
            return base
        if piece.mode is PieceMode.EAGER or compiler == "eager" or piece.compiled is None:
            base.reason = f"piece {piece.index} runs without codegen (compiler {compiler}, mode {piece.mode.value}):"
            base.reason += " every op is its own kernel"
            return base
        source = piece.compiled.source_code
        if not source:
            base.reason = "the compiler's generated code is not available to inspect"
            return base
        return _from_kernels(base, nodes, source)
    return FusionReport(group.name, list(group.ops), False, f"no piece holds the modules {list(group.ops)}")


def _from_kernels(report: FusionReport, nodes: dict[str, list[Node]], source: str) -> FusionReport:
    kernels = kernels_in(source)
    generated = [k for k in kernels if not k.is_extern]
    used: list[str] = []
    externs: list[str] = []
    pointwise = {_kind(n[0]) for n in nodes.values() if not {_kind(x) for x in n} & _MATMULS}
    for op, op_nodes in nodes.items():
        kinds = {_kind(n) for n in op_nodes}
        if kinds & _MATMULS:
            externs.append(op)
            used.append(f"extern matmul ({op})")
            continue
        # the kernel named after most of the group's pointwise ops (a norm's `mul` kernel is not the MLP's)
        holders = [k for k in generated if _kind(op_nodes[0]) in k.fused_ops]
        holder = max(holders, key=lambda k: len(pointwise & set(k.fused_ops)), default=None)
        used.append(holder.name if holder is not None else f"unknown kernel ({op})")
    report.kernels = list(dict.fromkeys(used))
    report.realised = len(report.kernels) == 1
    if report.realised:
        report.reason = f"all ops in {report.kernels[0]}"
    elif externs:
        fused = [k for k in report.kernels if not k.startswith("extern")]
        report.reason = (
            f"{', '.join(externs)} are matmuls the compiler leaves to extern BLAS kernels, which nothing fuses into"
            + (f"; the remaining ops fuse in {', '.join(fused)}" if fused else "")
        )
    else:
        report.reason = f"the ops land in {len(report.kernels)} kernels: {', '.join(report.kernels)}"
    return report


def _match(piece: Piece, group: FusionGroupConfig) -> tuple[str, dict[str, list[Node]]] | None:
    """(scope, {op: nodes}) for the first instance of the group's modules in `piece`, or None."""
    nodes = [n for n in piece.graph.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    module_ops = [op for op in group.ops if op.endswith("_proj") or "." in op]
    if not module_ops:
        return None
    scope = ""
    for node in nodes:
        path = node_module_path(node)
        leaf = path.rsplit(".", 1)[-1]
        if path and any(_module_matches(op, leaf) for op in module_ops):
            scope = path.rsplit(".", 1)[0]
            break
    if not scope:
        return None
    found: dict[str, list[Node]] = {}
    for node in nodes:
        path = node_module_path(node)
        if not path.startswith(scope):
            continue
        leaf = path.rsplit(".", 1)[-1]
        for op in group.ops:
            if _module_matches(op, leaf) if op in module_ops else _kind(node) == op:
                found.setdefault(op, []).append(node)
    return scope, found


def _module_matches(op: str, leaf: str) -> bool:
    """`gate_proj` matches `gate_proj` and the fused `gate_up_proj`; `q_proj` matches `qkv_proj`."""
    op = op.rsplit(".", 1)[-1]
    if op == leaf:
        return True
    if not (op.endswith("_proj") and leaf.endswith("_proj")):
        return False
    stem, fused = op.removesuffix("_proj"), leaf.removesuffix("_proj")
    return stem in fused.split("_") or (len(stem) == 1 and "_" not in fused and stem in fused)


def _kind(node: Node) -> str:
    """A short op name: silu, mul, linear, add, ..."""
    name = op_name(node.target).rsplit(".", 1)[-1]
    return {"__mul__": "mul", "__add__": "add", "truediv": "div"}.get(name, name)
