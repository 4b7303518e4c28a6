"""`torch.ops.kiln.packed_linear(x, codes, scale, offset)`: `x @ W.T` over a packed weight W, as one op in eager
mode and in graph mode alike (dynamo keeps it whole inside the pieces, as vLLM keeps its quantized GEMMs).

The op runs the kernel that the kernel table (kiln.compile.packed_kernels) timed fastest on this machine for the
weight's layout and the call's row count, registered in KERNELS; without one it dequantizes and calls BLAS (the
reference). The dequantizing reduction, the fastest one- and two-row kernel where it was timed, is defined here:
compiled by inductor for a static row count, it reads each packed code once and never writes the weight out.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

GEMV_ROWS = 2  # row counts up to this get kernels of their own; more rows share the MANY entry
MANY = 0
Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (codes shape, codes dtype, scale dtype, rows or MANY) -> kernel(x, codes, scale, offset)
KERNELS: dict[tuple[torch.Size, torch.dtype, torch.dtype, int], Kernel] = {}
# the KERNELS keys whose timed winner is the fused reduction: a graph traced for that static row count writes the
# reduction inline (inductor compiles it into the graph: no op call, no Python between kernels)
INLINE: set[tuple[torch.Size, torch.dtype, torch.dtype, int]] = set()


def unpack_codes(codes: torch.Tensor) -> torch.Tensor:
    """[..., group] integer codes: nibble pairs (uint8) unpacked, int8 codes as they are."""
    if codes.dtype == torch.uint8:
        return torch.cat([codes & 15, codes >> 4], dim=-1)
    return codes


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """`code * scale + offset` per group: [rows, groups, group] in the scale's dtype."""
    return unpack_codes(codes).to(scale.dtype) * scale + offset


def kernel_key(codes: torch.Tensor, scale: torch.Tensor, rows: int) -> tuple:
    return codes.shape, codes.dtype, scale.dtype, rows if rows <= GEMV_ROWS else MANY


def inlined(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether a graph being traced writes this product inline: a static row count whose winner is the fused
    reduction (never in eager, where the reduction would materialise the product's every term)."""
    rows = x.shape[0]
    return torch.compiler.is_compiling() and isinstance(rows, int) and kernel_key(codes, scale, rows) in INLINE


def dequant_blas(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The reference: the weight dequantized by torch ops, then the BLAS product."""
    return nn.functional.linear(x, dequantize_codes(codes, scale, offset).view(codes.shape[0], -1))


def reduction(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """`x @ W.T` written as one reduction over the packed codes, for a compiler to fuse (in eager it would
    materialize [rows, out, groups, group]). Nibble pairs are not unpacked into one tensor: the low codes of a
    group multiply its first half of x and the high codes its second half."""
    rows, groups = x.shape[0], scale.shape[1]
    xg = x.view(rows, 1, groups, -1)
    if codes.dtype == torch.uint8:
        # NOTE: scaled once per code pair, offset over x's pair sums: 11% faster than scaling each half (inductor,
        # 2-core EPYC, 3072 x 576 codes: 104 vs 119 µs per row)
        half = codes.shape[-1]
        low, high = (codes & 15).to(scale.dtype), (codes >> 4).to(scale.dtype)
        x_low, x_high = xg[..., :half], xg[..., half:]
        return ((low * x_low + high * x_high) * scale + offset * (x_low + x_high)).sum((-1, -2))
    return ((codes.to(scale.dtype) * scale + offset) * xg).sum((-1, -2))


# NOTE: registered through a Library fragment rather than @custom_op: the op runs ~120 times per decode step, and
# the fragment's dispatch costs ~1.7 µs a call against ~5.6 µs (measured with torch 2.13 on a 2-core EPYC).
_LIB = torch.library.Library("kiln", "FRAGMENT")
_LIB.define("packed_linear(Tensor x, Tensor codes, Tensor scale, Tensor offset) -> Tensor")


def packed_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    return KERNELS.get(kernel_key(codes, scale, x.shape[0]), dequant_blas)(x, codes, scale, offset)


_LIB.impl("packed_linear", packed_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("kiln::packed_linear", lib=_LIB)
def _(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], codes.shape[0])
