"""Packed weights in the model: `PackedLinear` (a linear layer whose weight stays packed and is dequantized inside
the product) and `PackedEmbedding` (lookups dequantize only the rows they gather), over `PackedTensor`s.

A packed [rows, cols] weight is, per group of `group` values along the input dimension, `code * scale + offset`:
codes are uint8 nibble pairs when they have 4 bits (byte i of a group holds code i low and code i + group/2 high),
int8 otherwise; scale and offset are one float per group.

The product is one op, `torch.ops.kiln.packed_linear` (kiln.quant.ops), in eager mode and inside graph-mode
pieces alike; it runs the kernels the engine's kernel plan timed fastest on this machine for the layer's layout
and the call's row count (kiln.kernels.packed), bound to the layer by `use_kernels`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kiln.quant.gguf_blocks import GROUP
from kiln.quant.ops import Kernel, bind_kernels, dequantize_codes, reduction, row_class, unpack_codes


@dataclass(frozen=True)
class PackedTensor:
    """A packed [rows, cols] weight as the loader yields it: codes [rows, groups, group or group/2], scale and
    offset [rows, groups, 1] float32; `bits` is the width of a code in its source format (4, 5, 6 or 8).

    `input_order` (act-ordered GPTQ groups): the codes' column j is the weight's column input_order[j], so that
    each group's columns are contiguous; the layer multiplies x[:, input_order] by them."""

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    bits: int = 8
    input_order: torch.Tensor | None = None

    @property
    def group(self) -> int:
        return self.codes.shape[-1] * (2 if self.codes.dtype == torch.uint8 else 1)

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * self.group

    def dequantize(self) -> torch.Tensor:
        """The [rows, cols] weight, its columns in the checkpoint's order."""
        weight = dequantize_codes(self.codes, self.scale, self.offset).reshape(self.shape)
        if self.input_order is None:
            return weight
        unordered = torch.empty_like(weight)
        unordered[:, self.input_order] = weight
        return unordered

    def narrow(self, dim: int, start: int, length: int) -> PackedTensor:
        """Rows (dim 0) or whole groups of columns (dim 1) of this weight: a tensor-parallel rank's shard."""
        if dim == 0:
            parts = (t.narrow(0, start, length) for t in (self.codes, self.scale, self.offset))
            return PackedTensor(*parts, bits=self.bits, input_order=self.input_order)
        if self.input_order is not None:
            raise ValueError("act-ordered columns (GPTQ desc_act) cannot be split across tensor-parallel ranks")
        if start % self.group or length % self.group:
            raise ValueError(f"columns [{start}, {start + length}) do not fall on groups of {self.group} values")
        g0, n = start // self.group, length // self.group
        return PackedTensor(*(t.narrow(1, g0, n) for t in (self.codes, self.scale, self.offset)), self.bits)

    def as_layout(self, nibbles: bool, group: int) -> PackedTensor:
        """The same values with codes stored as nibbles or int8 and groups of `group` (dividing this group):
        how the parts of a fused layer whose formats differ (Q4_K q and k, Q6_K v) share one layout."""
        if group > self.group or self.group % group or (nibbles and self.codes.dtype != torch.uint8):
            raise ValueError(f"cannot store {self.bits}-bit codes in groups of {self.group} as groups of {group}")
        codes, scale, offset = self.codes, self.scale, self.offset
        if not nibbles and codes.dtype == torch.uint8:
            codes = unpack_codes(codes).to(torch.int8)
        if group != self.group:
            split = self.group // group
            codes = codes.reshape(codes.shape[0], -1, group)
            scale, offset = scale.repeat_interleave(split, dim=1), offset.repeat_interleave(split, dim=1)
        return PackedTensor(codes, scale, offset, bits=self.bits, input_order=self.input_order)


class _Packed(nn.Module):
    """The buffers of a packed [out_features, in_features] weight."""

    def __init__(self, out_features: int, in_features: int, bits: int = 8, group: int = GROUP) -> None:
        super().__init__()
        if in_features % group or group % 2:
            raise ValueError(f"a packed weight needs in_features divisible by {group}, got {in_features}")
        self.in_features, self.out_features, self.bits, self.group = in_features, out_features, bits, group
        nibbles = bits == 4
        width, dtype = (group // 2, torch.uint8) if nibbles else (group, torch.int8)
        groups = in_features // group
        self.register_buffer("codes", torch.zeros(out_features, groups, width, dtype=dtype))
        self.register_buffer("scale", torch.zeros(out_features, groups, 1))
        self.register_buffer("offset", torch.zeros(out_features, groups, 1))

    def load_rows(self, offset: int, packed: PackedTensor) -> None:
        """Copy `packed` into rows [offset, offset + its rows) (one part of a fused q/k/v or gate/up weight)."""
        part = packed.as_layout(self.codes.dtype == torch.uint8, self.group)
        rows = part.codes.shape[0]
        for name in ("codes", "scale", "offset"):
            getattr(self, name).narrow(0, offset, rows).copy_(getattr(part, name))

    def to_dtype(self, dtype: torch.dtype) -> None:
        """Compute in `dtype`: the scale and offset are stored in it (codes stay as they are)."""
        self.scale.data = self.scale.data.to(dtype)
        self.offset.data = self.offset.data.to(dtype)

    def dequantized(self) -> torch.Tensor:
        return dequantize_codes(self.codes, self.scale, self.offset).view(self.out_features, self.in_features)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight [out, in] (computed: for reference checks and tools, not the forward)."""
        return self.dequantized()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.offset))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.bits}-bit codes x{self.group}"


class PackedLinear(_Packed):
    """`nn.Linear(in_features, out_features, bias)` over a packed weight; filled by the model's `load_weights`.
    `scheme`: "gguf" (blocks as the file stores them) or "int8" | "int4" (float weights quantized at load)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, scheme: str = "gguf", bits: int = 8, group=GROUP
    ) -> None:
        super().__init__(out_features, in_features, bits, group)
        self.scheme = scheme
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.tied = False  # shares an embedding's buffers (a tied logits head): not a checkpoint slot of its own
        # act-ordered codes (PackedTensor.input_order): the input's columns in the codes' order; None: as they come
        self.register_buffer("input_order", None)
        self.parts_loaded = 0
        # static row counts whose bound kernel is the fused reduction: a graph traced for one of them writes the
        # reduction inline (inductor compiles it into the graph: no op call, no Python between kernels)
        self.inline_rows: frozenset[int] = frozenset()

    def load_rows(self, offset: int, packed: PackedTensor) -> None:
        """As `_Packed.load_rows`; the parts of a fused layer must order their input columns alike (GPTQ's act
        order derives from the shared input, so q, k and v, or gate and up, get the same)."""
        order = packed.input_order
        if self.parts_loaded == 0:
            self.input_order = None if order is None else order.clone()
        elif (order is None) != (self.input_order is None) or (order is not None and not order.equal(self.input_order)):
            raise ValueError(
                "its input columns are act-ordered (g_idx) unlike the other parts of the fused layer it loads into; "
                "load the checkpoint with --quantization none"
            )
        super().load_rows(offset, packed)
        self.parts_loaded += 1

    def use_kernels(self, kernels: dict[int, Kernel], inline_rows: frozenset[int] = frozenset()) -> None:
        """Run `kernels` (by row class, kiln.quant.ops.row_class) for this layer's products, and write the
        reduction inline in graphs traced for `inline_rows` rows (never in eager, where the reduction would
        materialise every term of the product)."""
        bind_kernels(self.codes, kernels)
        self.inline_rows = frozenset(inline_rows)

    @classmethod
    def like(cls, linear: nn.Linear, scheme: str = "gguf", bits: int = 8, group: int = GROUP) -> PackedLinear:
        bias = linear.bias is not None
        return cls(linear.in_features, linear.out_features, bias=bias, scheme=scheme, bits=bits, group=group)

    @classmethod
    def tied_to(cls, embedding: PackedEmbedding) -> PackedLinear:
        """A logits head over the embedding's own buffers (tied word embeddings)."""
        head = cls(
            embedding.in_features,
            embedding.out_features,
            bias=False,
            scheme="gguf",
            bits=embedding.bits,
            group=embedding.group,
        )
        head.codes, head.scale, head.offset = embedding.codes, embedding.scale, embedding.offset
        head.tied = True
        return head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.input_order is not None:
            flat = flat.index_select(1, self.input_order)
        if self.inline(flat.shape[0]):
            out = reduction(flat, self.codes, self.scale, self.offset)
        else:
            out = torch.ops.kiln.packed_linear(flat, self.codes, self.scale, self.offset)
        out = out.view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def inline(self, rows: int | torch.SymInt) -> bool:
        """Whether a product of `rows` rows is written inline in the graph being traced (not the op)."""
        # NOTE: through row_class: a symbolic row count is compared (a guard), never hashed (which specialises it)
        return torch.compiler.is_compiling() and isinstance(rows, int) and row_class(rows) in self.inline_rows

    @property
    def plain(self) -> bool:
        """No input order and no bias: the product is `kiln::packed_linear` alone (what an op fusing more work after
        the product may stand in for)."""
        return self.input_order is None and self.bias is None

    def plain_op(self, x: torch.Tensor) -> bool:
        """Whether `forward(x)` is exactly `kiln::packed_linear(x, codes, scale, offset)`: a plain layer, x of
        [rows, in_features], not inline."""
        return self.plain and x.dim() == 2 and not self.inline(x.shape[0])


class PackedEmbedding(_Packed):
    """`nn.Embedding(num_embeddings, embedding_dim)` over a packed table: a lookup dequantizes its rows only."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bits: int = 8, group: int = GROUP) -> None:
        super().__init__(num_embeddings, embedding_dim, bits, group)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = dequantize_codes(self.codes[ids], self.scale[ids], self.offset[ids])
        return rows.reshape(*ids.shape, self.in_features)
