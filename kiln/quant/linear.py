"""`PackedLinear`: a linear layer whose weight stays packed (int8 codes, a scale and an offset per group of 32
along the input dimension) and is dequantized inside the product.

The forward is plain torch ops, `F.linear(x, codes * scale + offset)`, so graph mode traces it like any layer:
compiled for one or two static rows, the DecodeGemv pass turns the product into a reduction and inductor fuses the
dequantization into it (the weight streams at one byte per value plus two floats per group, not four bytes); for
dynamic sizes inductor emits one dequantizing kernel and the BLAS product. In eager mode the dequantization is its
own few ops per call: the reference, not the fast path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kiln.quant.gguf_blocks import GROUP


@dataclass(frozen=True)
class PackedTensor:
    """A packed [rows, cols] weight as the loader yields it: codes [rows, cols/32, 32] int8, scale and offset
    [rows, cols/32, 1] float32."""

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        rows, groups, group = self.codes.shape
        return rows, groups * group

    def dequantize(self) -> torch.Tensor:
        return (self.codes.float() * self.scale + self.offset).reshape(self.shape)


class PackedLinear(nn.Module):
    """`nn.Linear(in_features, out_features, bias)` over a packed weight; filled by the model's `load_weights`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, scheme: str = "gguf") -> None:
        super().__init__()
        self.scheme = scheme  # "gguf": blocks as the file stores them; "int8" | "int4": float weights quantized at load
        if in_features % GROUP:
            raise ValueError(f"a packed weight needs in_features divisible by {GROUP}, got {in_features}")
        self.in_features, self.out_features = in_features, out_features
        groups = in_features // GROUP
        self.register_buffer("codes", torch.zeros(out_features, groups, GROUP, dtype=torch.int8))
        self.register_buffer("scale", torch.zeros(out_features, groups, 1))
        self.register_buffer("offset", torch.zeros(out_features, groups, 1))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    @classmethod
    def like(cls, linear: nn.Linear, scheme: str = "gguf") -> PackedLinear:
        return cls(linear.in_features, linear.out_features, linear.bias is not None, scheme)

    def load_rows(self, offset: int, packed: PackedTensor) -> None:
        """Copy `packed` into rows [offset, offset + its rows) (one part of a fused q/k/v or gate/up weight)."""
        rows = packed.codes.shape[0]
        for name in ("codes", "scale", "offset"):
            getattr(self, name).narrow(0, offset, rows).copy_(getattr(packed, name))

    def to_dtype(self, dtype: torch.dtype) -> None:
        """Compute in `dtype`: the scale and offset are stored in it (codes stay int8)."""
        self.scale.data = self.scale.data.to(dtype)
        self.offset.data = self.offset.data.to(dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight [out, in] (computed: for reference checks and tools, not the forward)."""
        return self.dequantized()

    def dequantized(self) -> torch.Tensor:
        return (self.codes.to(self.scale.dtype) * self.scale + self.offset).view(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.dequantized(), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme} codes x{GROUP}"

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.offset))
