"""Data flow between the launches of one piece's generated code, in terms of the piece graph's inputs and its
weight products: which launch computes a product, which graph values each launch reads itself (kiln.compile.fusion
judges fusion groups on it). A packed weight (kiln.quant) counts as its codes: `kiln.packed_linear` reads them
itself; where a dequantization is written out for a BLAS product, that output stands for the weight."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.fx import Graph, Node

from kiln.compile.fusion_match import node_kind
from kiln.compile.kernels import Kernel

# packed_linear: kiln.quant.ops; packed_linear_lora: the same product and its LoRA adapters' (kiln.kernels.lora)
MATMULS = {"linear", "mm", "addmm", "bmm", "matmul", "packed_linear", "packed_linear_lora"}
# FX op kind -> the aten op inductor names a kernel after; other kinds (views, casts, splits) compute nothing
CODES = (torch.int8, torch.uint8)  # dtypes of a packed weight's codes (kiln.quant)
TOKENS = {k: k for k in ("silu", "mul", "add", "sub", "div", "neg", "pow", "mean", "rsqrt", "cat", "exp", "sum")}
TOKENS.update({"sigmoid": "sigmoid", "tanh": "tanh", "gelu": "gelu", "softmax": "softmax"})


class Flow:
    """Data flow between the launches of one piece's code, in terms of the piece graph's inputs and products."""

    def __init__(self, graph: Graph, kernels: list[Kernel]) -> None:
        self.kernels = kernels
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        inputs = {f"arg{i}_1": n for i, n in enumerate(placeholders) if is_tensor(n)}
        products = [n for n in graph.nodes if node_kind(n) in MATMULS and n.op != "placeholder"]
        weights: dict[str, list[Node]] = {}
        for p in products:
            w = _weight(p)
            if w is not None:
                weights.setdefault(f"arg{placeholders.index(w)}_1", []).append(p)
        self.up = _upstream(graph, set(inputs.values()) | set(products))
        packed = {name for name, n in inputs.items() if _dtype(n) in CODES}
        self.products = []
        for i, k in enumerate(kernels):
            held = {p for s in k.reads for p in weights.get(s, ())}
            if held and set(k.reads) & packed and _read_by_extern(k.writes, kernels[i + 1 :]):
                # a packed weight's dequantization, written out for a BLAS product: its output stands for the
                # weight, and the product is computed where that output is read
                for s in k.writes:
                    weights.setdefault(s, []).extend(held)
                held = set()
            self.products.append(held)
        self.product_launch = {p: i for i in reversed(range(len(kernels))) for p in self.products[i]}
        self.direct: list[set[Node]] = []  # graph inputs and products each launch reads (or computes) itself
        self.preds: list[set[int]] = []
        writer: dict[str, int] = {}
        for i, k in enumerate(kernels):
            direct, preds = set(self.products[i]), set()
            for s in k.reads:
                w = writer.get(s)
                if w is None and s in inputs:
                    direct.add(inputs[s])
                elif w is not None:
                    preds.add(w)
                    direct |= self.products[w]
            self.direct.append(direct)
            self.preds.append(preds)
            writer.update((s, i) for s in k.writes)

    def computing(self, node: Node) -> set[int]:
        op = token(node)
        return {
            i
            for i, k in enumerate(self.kernels)
            if not k.is_extern and op in k.fused_ops and self.up[node] <= self.direct[i]
        }

    def between(self, a: int, b: int) -> list[int]:
        """Launches on a data path from launch a to launch b."""
        reached = {a}
        for i in range(a + 1, b + 1):
            if self.preds[i] & reached:
                reached.add(i)
        back = {b}
        for i in range(b - 1, a, -1):
            if any(i in self.preds[j] for j in back):
                back.add(i)
        return sorted((reached & back) - {a, b})

    @staticmethod
    def ancestors(nodes: list[Node]) -> set[Node]:
        seen: set[Node] = set()
        todo = list(nodes)
        while todo:
            for m in todo.pop().all_input_nodes:
                if m not in seen:
                    seen.add(m)
                    todo.append(m)
        return seen


def _upstream(graph: Graph, anchors: set[Node]) -> dict[Node, set[Node]]:
    """node -> the anchors (graph inputs, products) it is computed from without passing another anchor."""
    up: dict[Node, set[Node]] = {}
    for n in graph.nodes:
        up[n] = set()
        for m in n.all_input_nodes:
            up[n] |= {m} if m in anchors else up[m]
    return up


def _weight(product: Node) -> Node | None:
    """The graph input a product's weight comes from (through views and transposes; for a packed weight, its int8
    codes through the dequantization), or None."""
    w = product.args[2] if node_kind(product) == "addmm" else product.args[1]
    while isinstance(w, Node) and w.op != "placeholder":
        inputs = w.all_input_nodes
        if len(inputs) != 1:
            codes = [m for m in Flow.ancestors([w]) if m.op == "placeholder" and _dtype(m) in CODES]
            return codes[0] if len(codes) == 1 else None
        w = inputs[0]
    return w


def _dtype(node: Node) -> torch.dtype | None:
    value = node.meta.get("example_value", node.meta.get("val"))
    return value.dtype if isinstance(value, torch.Tensor) else None


def _read_by_extern(buffers: Sequence[str], later: Sequence[Kernel]) -> bool:
    return any(k.is_extern and set(k.reads) & set(buffers) for k in later)


def token(node: Node) -> str | None:
    kind = node_kind(node)
    if kind == "getitem" and any(isinstance(a, Node) and is_tensor(a) for a in node.args[1:]):
        return "index"  # a gather such as cos_cache[positions]
    return TOKENS.get(kind)


def is_tensor(node: Node) -> bool:
    return isinstance(node.meta.get("example_value", node.meta.get("val")), torch.Tensor)
