"""The arithmetic of kiln's int8-activation kernels (packed_q8.cpp), written in plain torch: what every tier of the
native op must equal (tests/kernels), and a readable statement of what it computes.

Each row of x is quantized per group of the weight (the `group` inputs that share a scale): d = max|x| / 127,
q = round(x * (1 / d)) (half to even), and the group's float sum of x is kept for the offsets. Then

    out[r, o] = sum over groups g of  scale[o, g] * d[r, g] * (codes[o, g] . q[r, g])  +  offset[o, g] * xsum[r, g]

with the code dot products summed exactly in integers. With two digits (`packed_linear_q8x2`), the residual is
quantized again, q2 = round((x - q * d) * (1 / d) * 128), and the integer sums are 128 (codes . q) + (codes . q2) at
the scale d / 128: x to about 15 bits, on the same int8 dot products.
"""

from __future__ import annotations

import torch

from kiln.quant.ops import unpack_codes


def quantize_activations(
    x: torch.Tensor, group: int, digits: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [rows, in] float32 -> (q [rows, groups, group], d [rows, groups], xsum [rows, groups]); with two digits q is
    128 q + q2 (int32) and d the scale of that."""
    xg = x.view(x.shape[0], -1, group)
    d = xg.abs().amax(-1) / 127
    tiny = torch.finfo(x.dtype).tiny  # a subnormal scale (or 0): the group quantizes to 0, as in the kernel
    inverse = torch.where(d >= tiny, 1 / d, torch.zeros_like(d)).unsqueeze(-1)
    q = torch.round(xg * inverse)
    if digits == 2:
        q2 = torch.round((xg - q * d.unsqueeze(-1)) * (inverse * 128))
        return (q.to(torch.int32) * 128 + q2.to(torch.int32)), d / 128, xg.sum(-1)
    return q.to(torch.int8), d, xg.sum(-1)


def q8_linear(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, digits: int = 1
) -> torch.Tensor:
    """`x @ W.T` with x quantized to `digits` int8 digits per weight group (float64 sums of exact integer
    products)."""
    group = x.shape[1] // scale.shape[1]
    q, d, xsum = quantize_activations(x, group, digits)
    w = unpack_codes(codes).to(torch.float64)  # [out, groups, group], in x's order within a group
    isum = torch.einsum("rgi,ogi->rog", q.to(torch.float64), w)  # integers, exact in float64
    s, m = scale.squeeze(-1).double(), offset.squeeze(-1).double()
    out = (isum * (s.unsqueeze(0) * d.double().unsqueeze(1))).sum(-1) + xsum.double() @ m.t()
    return out.to(x.dtype)
