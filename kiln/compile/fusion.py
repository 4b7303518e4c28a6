"""Is each recipe fusion group realised in the generated code? If not, which op broke it, and why.

A group is *realised* in a piece's generated code when
1. its weight products (`gate_proj`, `up_proj`, ...) that read one input are one product: kiln's model merges
   gate/up and q/k/v into one weight each, so they are one GEMM;
2. one generated kernel computes all its pointwise ops (`silu`, `mul`, `add`, and every op of an `rms_norm` or
   `rotary_emb` module). The code does not say which graph node a kernel computes, so a kernel is taken to compute
   a node when it is named after the node's op (inductor names kernels after their aten ops) and reads the node's
   inputs itself: graph inputs and product outputs, not another kernel's buffer;
3. that kernel reads the output of every product feeding those ops directly (nothing runs in between), and
   computes itself every product that consumes their result. An extern BLAS GEMM reads its input from memory, so
   nothing fuses into it: `[silu, mul, down_proj]` cannot be realised where down_proj is an extern call (CPU,
   dynamic num_tokens), only in static-size code where DecodeGemv made products generated reductions.
The contract binds the code that runs for any num_tokens: the piece's dynamic compile. Static-size compiles are
reported alongside (`static`). kiln.compile.fusion_match finds the group's instance; identical pieces compile to
the same code, so one instance stands for all. The eager compiler and eager pieces generate no code: their groups
are reported unchecked. What is checked is a list of `CheckedCode`: the pieces (`piece_code`), or the layer units of
the full decode graph (kiln.compile.full_graph), which hold one decoder layer each.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from itertools import combinations
from typing import TYPE_CHECKING

from torch.fx import Graph, Node

from kiln.compile.fusion_flow import MATMULS, Flow, token
from kiln.compile.fusion_match import CheckedCode, GroupInstance, locate, node_kind
from kiln.compile.kernels import kernels_in
from kiln.compile.split import node_module_path
from kiln.config import FusionGroupConfig

if TYPE_CHECKING:
    from kiln.compile.piece import Piece


@dataclass
class FusionReport:
    name: str
    ops: list[str]
    realised: bool
    reason: str
    piece: int | None = None  # index of the piece (or layer unit) holding the instance
    code: str = ""  # what that is: `piece 1`, `full decode graph, layer unit 1/2`
    scope: str = ""
    kernels: list[str] = field(default_factory=list)  # the group's kernels, products first
    broken_by: str = ""  # the op that broke the group
    checked: bool = True  # False: no generated code to check (eager compiler or an eager piece)
    static: dict[str, bool] = field(default_factory=dict)  # static num_tokens -> realised in that compile


def piece_code(piece: Piece) -> CheckedCode:
    """A piece's graph and its compiled code for any num_tokens and per static size."""
    static = {n: c.source_code for n, c in sorted(piece.static_compiled.items()) if c.source_code}
    source = piece.compiled.source_code if piece.compiled is not None else None
    return CheckedCode(
        index=piece.index,
        label=piece.label,
        graph=piece.compile_source,
        source=source,
        mode=piece.mode.value,
        static_sources=static,
    )


def fusion_reports(
    codes: list[CheckedCode], groups: tuple[FusionGroupConfig, ...], compiler: str
) -> list[FusionReport]:
    return [_report(codes, g, compiler) for g in groups]


def as_json(reports: list[FusionReport]) -> list[dict]:
    return [asdict(r) for r in reports]


def _report(codes: list[CheckedCode], group: FusionGroupConfig, compiler: str) -> FusionReport:
    ops = list(group.ops)
    inst = locate(codes, group.ops, lambda c: compiler != "eager" and c.source is not None)
    if inst.piece is None:
        reason = f"none of {ops} is in the model's graph"
        return FusionReport(name=group.name, ops=ops, realised=False, reason=reason, broken_by=ops[0])
    code = inst.piece
    report = FusionReport(
        name=group.name, ops=ops, realised=False, reason="", piece=code.index, code=code.label, scope=inst.scope
    )
    missing = [op for op in ops if op not in inst.nodes]
    if missing:
        op, other = missing[0], inst.elsewhere.get(missing[0])
        report.broken_by = op
        report.reason = f"{op} is not in {inst.scope or 'the graph'} ({code.label})"
        if other is not None:
            side = "next" if other > code.index else "previous"
            report.reason = f"{op} is in the {side} piece ({other}): attention splits the graph between them"
        return report
    source = code.source if compiler != "eager" else None
    if source is None:
        report.checked = False
        report.reason = (
            f"{code.label} has no generated code to check (compiler {compiler}, mode {code.mode}):"
            " every op runs as its own kernel"
        )
        return report
    graph = code.graph.graph
    report.realised, report.reason, report.kernels, report.broken_by = _Verdict(graph, inst, source).result
    for size, static in sorted(code.static_sources.items()):
        report.static[str(size)] = _Verdict(graph, inst, static).result[0]
    if not report.realised and any(report.static.values()):
        sizes = ", ".join(n for n, ok in report.static.items() if ok)
        report.reason += f" (the static num_tokens={sizes} code realises it)"
    return report


class _Verdict:
    """Whether one compiled piece's code realises a group instance: `result` = (realised, reason, kernels, op)."""

    def __init__(self, graph: Graph, inst: GroupInstance, source: str) -> None:
        self.kernels = kernels_in(source)
        self.flow = Flow(graph, self.kernels)
        self.owner: dict[Node, str] = {}  # product -> the group's ops it computes ("gate_proj, up_proj")
        self.pointwise: dict[str, list[Node]] = {}
        for op, nodes in inst.nodes.items():
            products = [n for n in nodes if node_kind(n) in MATMULS]
            for p in products:
                self.owner[p] = f"{self.owner[p]}, {op}" if p in self.owner else op
            if not products:
                self.pointwise[op] = [n for n in nodes if token(n)]
        self.every_node = inst.modules
        self.result = self._judge()

    def _judge(self) -> tuple[bool, str, list[str], str]:
        products = list(self.owner)
        for a, b in combinations(products, 2):
            if a.args[0] is b.args[0]:
                why = f"{self.owner[a]} and {self.owner[b]} are two GEMMs over one input: merge their weights"
                return False, why, [], self.owner[b]
        if not self.pointwise:
            return self._products_only(products)
        best, broken = self._pointwise_kernel()
        if broken:
            return False, broken[1], [], broken[0]
        group_nodes = {n for ns in self.pointwise.values() for n in ns}
        feeding = self.flow.ancestors(list(group_nodes))
        for p in products:
            why = self._product_problem(p, best, p in feeding, bool(self.flow.ancestors([p]) & group_nodes))
            if why:
                return False, why, [], self.owner[p]
        launches = sorted({best, *(self.flow.product_launch[p] for p in products)})
        why = f"{', '.join(self.pointwise)} in {self.kernels[best].name}"
        fed = [f"{self.owner[p]} ({_leaf(p)})" for p in products if p in feeding and p not in self.flow.products[best]]
        if fed:
            why += f", which reads the GEMM output of {', '.join(fed)} directly"
        return True, why, [self.kernels[i].name for i in launches], ""

    def _pointwise_kernel(self) -> tuple[int, tuple[str, str] | None]:
        """The generated launch holding most of the pointwise ops; (op, why) for one it does not hold."""
        holders = {op: self._holders(op) for op in self.pointwise}
        generated = [i for i, k in enumerate(self.kernels) if not k.is_extern]
        if not generated:
            return -1, (next(iter(self.pointwise)), "the piece's code has no generated kernel")
        best = max(generated, key=lambda i: (sum(i in h for h in holders.values()), -i))
        for op, held in holders.items():
            if best not in held:
                where = ", ".join(self.kernels[i].name for i in sorted(held)) or "no kernel that reads its inputs"
                kernel = self.kernels[best].name
                return best, (op, f"{op} is not in {kernel}, the kernel with most of the group (it is in {where})")
        return best, None

    def _product_problem(self, p: Node, best: int, feeds: bool, consumes: bool) -> str:
        """Why product `p` breaks the group whose pointwise ops launch `best` computes, or "" if it does not."""
        op, launch = self.owner[p], self.flow.product_launch.get(p)
        if launch is None:
            return f"no kernel of the code reads {op}'s weight"
        name, kernel = self.kernels[launch].name, self.kernels[best].name
        if feeds and p not in self.flow.direct[best]:
            between = ", ".join(self.kernels[i].name for i in self.flow.between(launch, best))
            return f"{op}'s output ({name}) reaches {kernel} only through {between}, which are not in the group"
        if not feeds and not consumes:
            return f"{op} shares no data with the group's other ops"
        if not feeds and p not in self.flow.products[best]:
            if self.kernels[launch].is_extern:
                return f"{op} is an extern BLAS GEMM; nothing fuses into its input ({name})"
            return f"{op} runs in its own kernel {name}, not in {kernel}"
        return ""

    def _products_only(self, products: list[Node]) -> tuple[bool, str, list[str], str]:
        first = self.flow.product_launch.get(products[0])
        for p in products:
            if first is None or self.flow.product_launch.get(p) != first:
                return False, f"{self.owner[p]} is a separate product ({_leaf(p)})", [], self.owner[p]
        name = self.kernels[first].name
        return True, f"{', '.join(self.owner.values())} are one product ({_leaf(products[0])}): {name}", [name], ""

    def _holders(self, op: str) -> set[int]:
        """Launches computing the op: any of its nodes (a plain op), every one (a module such as rms_norm)."""
        sets = [self.flow.computing(n) for n in self.pointwise[op]]
        if not sets:
            return set(range(len(self.kernels)))
        return set.intersection(*sets) if op in self.every_node else set.union(*sets)


def _leaf(node: Node) -> str:
    return node_module_path(node).rsplit(".", 1)[-1] or node.name
