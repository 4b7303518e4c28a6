"""Inductor graph passes kiln adds to piece compilation (run post-grad, in this order)."""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

aten = torch.ops.aten

# Static pieces with at most this many rows turn weight products into GEMV reductions (see DecodeGemv).
GEMV_MAX_ROWS = 2


class UnfuseResidualAddmm(CustomGraphPass):
    """Post-grad: turn `addmm(residual, x, w)` back into `mm(x, w) + residual`, as eager computes it.

    NOTE: inductor fuses the residual add into BLAS addmm (beta=1). For one-row products MKL's GEMV then
    accumulates in another order than eager's mm followed by an add, and a 30-layer model drifts ~1e-3 in the
    logits (measured on SmolLM2, column-major weights). Keeping the add separate costs one fused pointwise
    kernel and makes compiled pieces match eager within 1e-4, which the graph-vs-eager debugger relies on.
    """

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not aten.addmm.default or node.kwargs:
                continue
            inp, mat1, mat2 = node.args
            with graph.inserting_before(node):
                mm = _call(graph, aten.mm.default, mat1, mat2)
                add = _call(graph, aten.add.Tensor, mm, inp)
            node.replace_all_uses_with(add)
            graph.erase_node(node)

    def uuid(self) -> str:
        return "kiln.UnfuseResidualAddmm.v1"


class DecodeGemv(CustomGraphPass):
    """Post-grad, pieces compiled for a static num_tokens <= GEMV_MAX_ROWS: `mm(x, W.T)` over a row-major
    weight W [out, in] becomes `sum(x[:, None, :] * W, -1)`, which inductor emits as one vectorized,
    parallel reduction kernel.

    NOTE: batch-1 decode on CPU is weight-bandwidth bound and MKL's fp32 GEMV is single-threaded and far from
    the memory roofline: for SmolLM2's decoder layers it streams 10-15 GB/s (row-major W) or 15-21 GB/s
    (column-major W), while the reduction kernel streams ~28 GB/s on both cores (scripts/gemv_bench.py;
    `sum` over 1 GiB reads ~31 GB/s here). For one and two rows the extra multiplies are free; from four rows
    on the reduction re-reads W per row and MKL's blocked GEMM wins, so larger pieces keep `mm`. A weight
    that is not row-major (its transpose is not contiguous along `in`) keeps `mm` too.
    """

    def __call__(self, graph: torch.fx.Graph) -> None:
        _dense_to_mm(graph)
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not aten.mm.default:
                continue
            x, w_t = node.args
            x_val, w_val = x.meta["val"], w_t.meta["val"]
            rows = x_val.shape[0]
            if not isinstance(rows, int) or rows > GEMV_MAX_ROWS or w_val.dim() != 2 or w_val.stride()[0] != 1:
                continue
            with graph.inserting_before(node):
                w = _call(graph, aten.permute.default, w_t, [1, 0])  # [out, in], contiguous along `in`
                xs = _call(graph, aten.unsqueeze.default, x, 1)  # [rows, 1, in]
                prod = _call(graph, aten.mul.Tensor, xs, w)  # [rows, out, in]
                out = _call(graph, aten.sum.dim_IntList, prod, [2])  # [rows, out]
            node.replace_all_uses_with(out)
            graph.erase_node(node)

    def uuid(self) -> str:
        return f"kiln.DecodeGemv.v2.rows{GEMV_MAX_ROWS}"


class KilnPostGradPasses(CustomGraphPass):
    """The passes above as inductor's one `post_grad_custom_post_pass` slot."""

    def __init__(self) -> None:
        self.passes: list[CustomGraphPass] = [UnfuseResidualAddmm(), DecodeGemv()]

    def __call__(self, graph: torch.fx.Graph) -> None:
        for graph_pass in self.passes:
            graph_pass(graph)

    def uuid(self) -> str:
        return "+".join(str(p.uuid()) for p in self.passes)


def _dense_to_mm(graph: torch.fx.Graph) -> None:
    """`kiln::dense_linear(x, W, b)` (a dense layer whose prepacked kernel won some row class, kiln.kernels.dense) for
    a static x of at most GEMV_MAX_ROWS rows becomes `mm(x, W.T) (+ b)`, which DecodeGemv then reduces: the kernel
    plan timed the prepacked product only at row counts that are not static GEMV sizes."""
    for node in list(graph.nodes):
        if node.op != "call_function" or str(node.target) != "kiln.dense_linear.default":
            continue
        x, w, bias = (*node.args, None)[:3]
        rows = x.meta["val"].shape[0]
        if x.meta["val"].dim() != 2 or not isinstance(rows, int) or rows > GEMV_MAX_ROWS:
            continue
        with graph.inserting_before(node):
            out = _call(graph, aten.mm.default, x, _call(graph, aten.permute.default, w, [1, 0]))
            if bias is not None:
                out = _call(graph, aten.add.Tensor, out, bias)
        node.replace_all_uses_with(out)
        graph.erase_node(node)


def _call(graph: torch.fx.Graph, target: torch._ops.OpOverload, *args: object) -> torch.fx.Node:
    """A new node for `target(*args)` with its fake value in meta["val"], as inductor's lowering expects."""
    node = graph.call_function(target, args)
    values = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
    node.meta["val"] = target(*values)
    return node
