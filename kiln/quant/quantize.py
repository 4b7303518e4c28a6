"""Load-time weight-only quantization of float weights into kiln's packed form (`--quantization int8|int4`):
per group of 32 values (`--quantization-group-size`, the recipe's `quantization.group_size`) along the input
dimension, `w ≈ code * scale + offset`.

- int8, symmetric: scale = max|w| / 127, code = round(w / scale) in [-127, 127], offset = 0.
- int4, asymmetric: scale = (max - min) / 15, code = round((w - min) / scale) in [0, 15] (two to a byte) and
  offset = min, so every group's range is covered and each value is off by at most scale / 2.
A group of equal values gets scale 1 and codes that reproduce it exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kiln.quant.gguf_blocks import GROUP
from kiln.quant.linear import PackedTensor


def _int8(w: torch.Tensor) -> PackedTensor:
    scale = w.abs().amax(-1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(w / scale).clamp(-127, 127)
    return PackedTensor(codes.to(torch.int8), scale, torch.zeros_like(scale), bits=8)


def _int4(w: torch.Tensor) -> PackedTensor:
    low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = (high - low) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((w - low) / scale).clamp(0, 15).to(torch.uint8)
    half = w.shape[-1] // 2
    return PackedTensor(q[..., :half] | (q[..., half:] << 4), scale, low, bits=4)


# scheme -> how a [rows, groups, group] float weight is packed; a new scheme is one function and one entry
SCHEMES: dict[str, Callable[[torch.Tensor], PackedTensor]] = {"int8": _int8, "int4": _int4}
BITS = {"int8": 8, "int4": 4}


def quantize(weight: torch.Tensor, scheme: str, group: int = GROUP) -> PackedTensor:
    """`weight` [rows, cols] (cols a multiple of the even `group`) packed under `scheme` (a `SCHEMES` name)."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}: expected one of {', '.join(SCHEMES)}")
    rows, cols = weight.shape
    return SCHEMES[scheme](weight.detach().float().reshape(rows, cols // group, group))
