"""Inductor graph passes kiln adds to piece compilation."""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

aten = torch.ops.aten


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
                mm = graph.call_function(aten.mm.default, (mat1, mat2))
                mm.meta["val"] = aten.mm.default(mat1.meta["val"], mat2.meta["val"])
                add = graph.call_function(aten.add.Tensor, (mm, inp))
                add.meta["val"] = node.meta["val"]
            node.replace_all_uses_with(add)
            graph.erase_node(node)

    def uuid(self) -> str:
        return "kiln.UnfuseResidualAddmm.v1"
