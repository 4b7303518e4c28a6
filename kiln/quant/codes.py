"""Integer weights as quantized checkpoints store them (compressed-tensors, GPTQ, AWQ) -> kiln's packed form.

Those formats describe a [rows, cols] weight as `w = (q - zero) * scale`, with one scale and one zero point per
row and group of `group` columns (a channel strategy: one group per row), and `q`, `zero` integers of `bits` bits
in the format's own range (signed -2^(b-1)..2^(b-1)-1 for compressed-tensors, unsigned 0..2^b-1 for GPTQ and AWQ).

kiln's form is `w = code * scale + offset` (kiln.quant.linear): 4-bit codes 0..15 two to a byte, wider codes int8.
So code = q shifted into kiln's range and offset = -(zero shifted the same way) * scale, in float32: the
multiply-add differs from `(q - zero) * scale` by a rounding of each product, well under 1e-5 of the weights.
"""

from __future__ import annotations

import torch

from kiln.quant.gguf_blocks import GROUP
from kiln.quant.linear import PackedTensor


def integer_form(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bits: int,
    signed: bool,
) -> PackedTensor:
    """kiln's packed form of `w = (q - zero) * scale`: `q` [rows, cols] integers of `bits` bits (`signed`: in
    -2^(b-1)..2^(b-1)-1, else 0..2^b-1), `scale` and `zero` (None: 0) [rows, groups] with groups dividing cols.

    A channel scale (one group) is repeated over groups of 32 columns where cols allows: the same values, and the
    packed kernels' common group size."""
    rows, cols = q.shape
    groups = scale.shape[-1]
    if cols % groups:
        raise ValueError(f"{groups} groups of scales do not divide {cols} columns")
    scale = scale.reshape(rows, groups).float()
    zero = torch.zeros_like(scale) if zero is None else zero.reshape(rows, groups).float()
    group = packed_group(cols, groups)
    if group is None:
        raise ValueError(f"groups of {cols // groups} columns: kiln's packed form needs an even group size")
    if group != cols // groups:
        split = cols // groups // group
        scale, zero = scale.repeat_interleave(split, 1), zero.repeat_interleave(split, 1)
        groups = cols // group
    # kiln's codes: 0..15 for 4 bits, signed int8 otherwise
    shift = (8 if signed else 0) if bits == 4 else (0 if signed else -(1 << (bits - 1)))
    codes = (q.to(torch.int16) + shift).reshape(rows, groups, group)
    offset = -((zero + shift) * scale)
    scale, offset = scale.unsqueeze(-1), offset.unsqueeze(-1)
    if bits == 4:
        codes = codes.to(torch.uint8)
        half = group // 2
        return PackedTensor(codes[..., :half] | (codes[..., half:] << 4), scale, offset, bits=4)
    return PackedTensor(codes.to(torch.int8), scale, offset, bits=bits)


def packed_group(cols: int, groups: int) -> int | None:
    """The group size of `integer_form` for `groups` scales over `cols` columns: cols / groups, or 32 for one
    scale per row (a channel strategy) where 32 divides cols; None where kiln cannot pack it (an odd group)."""
    if cols % groups:
        return None
    group = cols // groups
    if groups == 1 and cols % GROUP == 0:
        return GROUP
    return group if group % 2 == 0 else None


def ordered_form(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int, signed: bool, g_idx: torch.Tensor
) -> PackedTensor | torch.Tensor:
    """`integer_form` of a weight whose columns belong to the groups `g_idx` [cols] names (act order): its columns
    sorted by group into contiguous groups, the sort kept as the input order the layer applies to x. Groups of
    unequal sizes have no such form: the format's own dequantization (float32) instead."""
    cols, groups = q.shape[1], scale.shape[-1]
    g_idx = g_idx.long()
    if cols % groups == 0 and torch.equal(g_idx, torch.arange(cols) // (cols // groups)):
        return integer_form(q, scale, zero, bits, signed)
    order = torch.argsort(g_idx, stable=True)
    if cols % groups or not torch.equal(g_idx[order], torch.arange(cols) // (cols // groups)):
        return reference_weight(q, scale, zero, g_idx)
    packed = integer_form(q[:, order], scale, zero, bits, signed)
    return PackedTensor(packed.codes, packed.scale, packed.offset, packed.bits, input_order=order)


def packable_order(g_idx: torch.Tensor | None, cols: int, groups: int) -> bool:
    """Whether `ordered_form` packs a weight with this `g_idx` (None: contiguous groups): every group equally big."""
    if g_idx is None:
        return True
    counts = torch.bincount(g_idx.long(), minlength=groups)
    return cols % groups == 0 and bool((counts == cols // groups).all())


def reference_weight(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_of_column: torch.Tensor | None = None
) -> torch.Tensor:
    """`(q - zero) * scale` in float32, per column's group (`group_of_column` [cols]; default: contiguous groups):
    the formats' own dequantization, which act-ordered weights use when they do not pack."""
    rows, cols = q.shape
    groups = scale.shape[-1]
    if group_of_column is None:
        group_of_column = torch.arange(cols) // (cols // groups)
    index = group_of_column.long()
    zero_cols = 0.0 if zero is None else zero.reshape(rows, groups).float()[:, index]
    return (q.float() - zero_cols) * scale.reshape(rows, groups).float()[:, index]
