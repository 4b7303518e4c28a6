"""The kernels kiln's torch candidates build (kiln.kernels.candidates): dequantize-then-BLAS in tiles of output rows,
the layer's dequantization compiled for any row count, and torch's int4 kernel over its own copy of the codes."""

from __future__ import annotations

import torch
from torch import nn

from kiln.compile.compiler import PieceCompiler
from kiln.kernels.product import Compiled, shared_compile
from kiln.quant.linear import PackedLinear
from kiln.quant.ops import dequantize_codes

TILE_ROWS = 2048  # output rows dequantized at a time by TILED: a tile stays in cache for its product
Weight = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # codes, scale, offset


class Tiled:
    """Dequantize-then-BLAS over TILE_ROWS output rows at a time (the dequantization compiled for any row count)."""

    def __init__(self, layer: PackedLinear, compiler: PieceCompiler) -> None:
        self.tiles = [
            (start, min(TILE_ROWS, layer.out_features - start)) for start in range(0, layer.out_features, TILE_ROWS)
        ]
        self.dequant = dequantizer(layer, compiler)  # any tile

    def __call__(self, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        outs = []
        for start, rows in self.tiles:
            part = slice(start, start + rows)
            weight = self.dequant(codes[part], scale[part], offset[part]).view(rows, -1)
            outs.append(nn.functional.linear(x, weight))
        return torch.cat(outs, dim=1)


def layer_weight(layer: PackedLinear) -> Weight:
    return layer.codes, layer.scale, layer.offset


def dequantizer(layer: PackedLinear, compiler: PieceCompiler) -> Compiled:
    """The layer's dequantization compiled for any row count (layouts and tiles)."""
    return shared_compile(dequantize_codes, compiler, *layer_weight(layer))


class Int4Packed:
    """torch's CPU int4 kernel over its own copy of each weight's codes in torch's int4 layout (0.5 byte a weight)
    and per group (scale, zero) with w = (q - 8) * scale + zero, so zero = offset + 8 * scale. The weights given
    are repacked up front (as before serving); another is repacked at its first call."""

    def __init__(self, weights: list[Weight]) -> None:
        self.packed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # codes' address -> (repacked codes, pairs)
        for weight in weights:
            self._repacked(*weight)

    def _repacked(self, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, ...]:
        packed = self.packed.get(codes.data_ptr())
        if packed is None:
            q = torch.cat([codes & 15, codes >> 4], dim=-1).reshape(codes.shape[0], -1).to(torch.int32)
            s, o = scale.squeeze(-1), offset.squeeze(-1)
            pairs = torch.stack([s.t(), (o + 8 * s).t()], dim=-1).contiguous()  # [groups, out, 2]
            q4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            packed = self.packed[codes.data_ptr()] = (q4, pairs)
        return packed

    def __call__(self, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        weight, pairs = self._repacked(codes, scale, offset)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight, 32, pairs)
