"""Graph mode's kernel choice for packed weights (kiln.quant): which small row counts compile to one fused
dequantizing reduction, timed against dequantize-then-BLAS on this machine and cached like the float choice.

Candidates, per row count (1 and 2, the sizes DecodeGemv can reduce), on the model's largest packed layer with
copies streamed from DRAM:
- `dequant-blas`: the layer's own forward, uncompiled: codes * scale + offset written out, then BLAS;
- `fused-reduction`: the same forward compiled for the static row count: DecodeGemv turns the product into a
  reduction and inductor fuses the dequantization into it, so the weight streams as one byte per value.
A row count becomes a static compile size when the fused reduction wins.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.fx import GraphModule

from kiln.compile.compiler import PieceCompiler
from kiln.compile.logits_head import trace_static
from kiln.compile.passes import GEMV_MAX_ROWS
from kiln.executor.kernel_choice import KernelChoiceCache, stream_count, time_per_call_us
from kiln.quant.linear import PackedLinear

DEQUANT_BLAS, FUSED = "dequant-blas", "fused-reduction"
_BUFFERS = ("codes", "scale", "offset")


def _packed_product(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> tuple:
    weight = (codes.to(scale.dtype) * scale + offset).view(codes.shape[0], -1)
    return (torch.nn.functional.linear(x, weight),)


def choose_packed_static_sizes(
    layer: PackedLinear, capture_sizes: Sequence[int], compiler: PieceCompiler, cache: KernelChoiceCache
) -> dict[str, object]:
    """{"static_sizes", "times_us": {rows: {candidate: µs}}, "source"} for the packed layer's shape."""
    rows_to_time = [r for r in range(1, GEMV_MAX_ROWS + 1) if r in capture_sizes]

    def measure() -> dict[str, object]:
        times = {str(rows): _time(layer, rows, compiler) for rows in rows_to_time}
        wins = [int(r) for r, t in times.items() if t[FUSED] < t[DEQUANT_BLAS]]
        return {"static_sizes": wins if 1 in wins else [], "times_us": times}

    dtype = str(layer.scale.dtype).removeprefix("torch.")
    key = {"shape": [layer.out_features, layer.in_features], "dtype": dtype, "rows": rows_to_time}
    return cache.choose("packed_gemv", key, measure)


def _time(layer: PackedLinear, rows: int, compiler: PieceCompiler) -> dict[str, float]:
    x = torch.randn(rows, layer.in_features, dtype=layer.scale.dtype)
    buffers = [getattr(layer, name) for name in _BUFFERS]
    packed_bytes = sum(t.numel() * t.element_size() for t in buffers)
    copies = [tuple(b.clone() for b in buffers) for _ in range(stream_count(packed_bytes))]  # streamed from DRAM
    graph = trace_static(_packed_product, x, *buffers)
    compiled = compiler.compile(graph, rows)
    order = [_BUFFERS.index(n) if n in _BUFFERS else -1 for n in _placeholder_names(graph)]

    def fused(w: tuple) -> Any:
        return compiled.fn(*[x if i < 0 else w[i] for i in order])

    times = {
        DEQUANT_BLAS: time_per_call_us(lambda w: _packed_product(x, *w), copies),
        FUSED: time_per_call_us(fused, copies),
    }
    return {k: round(v, 2) for k, v in times.items()}


def _placeholder_names(graph: GraphModule) -> list[str]:
    """Each input's argument name (dynamo calls them `L_codes_`, ...); `x` for the activation."""
    return [n.target.removeprefix("L_").rstrip("_") for n in graph.graph.nodes if n.op == "placeholder"]
