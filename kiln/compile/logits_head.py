"""The one-row logits head compiled like the pieces (CPU, static size 1): one GEMV reduction over the head.

Batch-1 decode streams the logits head (the largest single weight) once per token; compiled for one static row,
the DecodeGemv pass (kiln.compile.passes) turns it into the same vectorized reduction the pieces use.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule

from kiln.compile.compiler import CompiledPiece


def _logits(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor]:
    return (torch.mm(hidden, weight.t()).float(),)


def logits_head_graph(weight: torch.Tensor) -> GraphModule:
    """The one-row logits product traced by dynamo (inputs: hidden [1, hidden_size] and the head weight)."""
    graphs: list[GraphModule] = []

    def grab(gm: GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(gm)
        return gm.forward

    hidden = torch.zeros(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
    with torch.inference_mode():
        torch.compile(_logits, backend=grab, fullgraph=True, dynamic=False)(hidden, weight)
    return graphs[0]


class CompiledLogitsHead:
    """Calls the compiled one-row head with its arguments in the order dynamo traced them."""

    def __init__(self, compiled: CompiledPiece, graph: GraphModule, weight: torch.Tensor) -> None:
        self.compiled = compiled
        self.weight = weight
        first = next(n for n in graph.graph.nodes if n.op == "placeholder")
        # NOTE: dynamo orders a graph's inputs its own way (here the weight first): find it by its shape.
        self.weight_first = tuple(first.meta["example_value"].shape) == tuple(weight.shape)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        args = (self.weight, hidden) if self.weight_first else (hidden, self.weight)
        return self.compiled.fn(*args)[0]
