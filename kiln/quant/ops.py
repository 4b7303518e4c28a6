"""`torch.ops.kiln.packed_linear(x, codes, scale, offset)`: `x @ W.T` over a packed weight W, as one op in eager
mode and in graph mode alike (dynamo keeps it whole inside the pieces, as vLLM keeps its quantized GEMMs).

The op runs the kernels bound to its weight: an engine's kernel plan (kiln.kernels.plan) times candidates on this
machine and binds the winners to each packed layer's codes (`bind_kernels`, through `PackedLinear.use_kernels`).
The binding belongs to the weight, not to the process: engines over other models never see it, engines over the
same model share the same timed choices (kiln.kernels.choices) and so bind the same kernels. A weight nothing
was bound to runs the reference: dequantize, then BLAS. The dequantizing reduction, the fastest one- and two-row
kernel where it was timed, is defined here: compiled by inductor for a static row count, it reads each packed
code once and never writes the weight out.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

import torch
from torch import nn

K = TypeVar("K")
GEMV_ROWS = 2  # row counts up to this get kernels of their own; more rows share an entry with their neighbours
# the largest row count of each kernel entry (its id): 1, 2, 3-6 (speculative verification of one sequence, tiny
# batches), 7-16 (small decode batches), 17-64 (decode batches up to the default --max-num-seqs), 65-256 (short
# prefill chunks, mixed steps); more rows (prefill chunks up to --max-num-batched-tokens) share the LARGE entry: a
# kernel whose work grows with the rows can win 256 rows and lose 2048 to dequantize-then-BLAS, whose dequantization
# is paid once for all of them. NOTE: 3-6 apart from 7-16 since the bf16 second form (kiln.kernels.compute_forms)
# wins 16 rows and loses 5 to the packed int8 kernels, which read a third of its bytes: a class timed at 16 rows gave
# a 5-row verification step the slower kernel. The native dispatch is handed these (kiln.kernels.native.build).
ROW_CLASSES = (*range(1, GEMV_ROWS + 1), 6, 16, 64, 256)
LARGE = -1
ENTRIES = (*ROW_CLASSES, LARGE)  # the row classes in the order the native dispatch indexes its entries
Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class BoundKernels(Generic[K]):
    """Which kernel serves which weight at which row class: the one table of bindings, one instance per op
    (`kiln::packed_linear` below, `kiln::dense_linear` in kiln.kernels.dense). A binding belongs to the weight
    (keyed by its address, shape and dtype, held weakly) and dies with it. Where kiln's native objects load, the
    op's C++ kernel (kiln/kernels/native/dispatch.cpp) keeps a copy of each binding, handed over by `bind`'s
    caller as `bind` returns it: one kernel or None per entry of ENTRIES."""

    def __init__(self) -> None:
        self._bound: dict[tuple[int, torch.Size, torch.dtype], tuple[weakref.ref[torch.Tensor], dict[int, K]]] = {}

    def bind(self, weight: torch.Tensor, kernels: dict[int, K]) -> list[K | None]:
        """Run `kernels` (by row class) for products over `weight`; the kernels by entry of ENTRIES."""
        self._bound[_weight_key(weight)] = (weakref.ref(weight), dict(kernels))
        for key in [k for k, (ref, _) in self._bound.items() if ref() is None]:
            del self._bound[key]
        return [kernels.get(top) for top in ENTRIES]

    def get(self, weight: torch.Tensor, rows: int) -> K | None:
        """The kernel bound to `weight` for `rows` rows, None where none is."""
        entry = self._bound.get(_weight_key(weight))
        if entry is None or entry[0]() is None:
            return None
        return entry[1].get(row_class(rows))


_BOUND = BoundKernels[Kernel]()


def row_class(rows: int) -> int:
    """The kernel entry `rows` rows use: the first of ROW_CLASSES at least `rows`, LARGE above them (a kernel that
    wins a batched decode step can lose a 512-row prefill chunk to BLAS, so each is timed)."""
    return next((top for top in ROW_CLASSES if rows <= top), LARGE)


def rows_label(timed: int) -> str:
    """What the row class timed at `timed` rows stands for, in a log line: "1 row", "7-16 rows", "257+ rows"."""
    if timed <= GEMV_ROWS:
        return f"{timed} row{'s' if timed > 1 else ''}"
    if row_class(timed) == LARGE:
        return f"{ROW_CLASSES[-1] + 1}+ rows"
    below = max(top for top in ROW_CLASSES if top < timed)
    return f"{below + 1}-{timed} rows"


def _weight_key(weight: torch.Tensor) -> tuple[int, torch.Size, torch.dtype]:
    return weight.data_ptr(), weight.shape, weight.dtype


# Where kiln's native objects load, the op's CPU kernel is C++ (kiln/kernels/native/dispatch.cpp): it calls the
# bound native ops itself and this module's implementation for the rest. `(codes, [op name or "" per entry],
# [a form of the weight the entry's op multiplies instead of the codes, or None, per entry])`.
NativeBinder = Callable[[torch.Tensor, list[str], list[torch.Tensor | None]], None]
_native_binders: list[NativeBinder] = []


def use_native_binder(binder: NativeBinder) -> None:
    """From now on, tell the op's C++ kernel (installed by kiln.kernels.native) about every binding too."""
    _native_binders[:] = [binder]


def native_op_name(kernel: Kernel | None) -> str:
    """ "kiln_native_<tier>::<op>" for a kernel that is one of kiln's native ops, "" for any other kernel."""
    name = getattr(kernel, "_qualified_op_name", "")
    return name if isinstance(name, str) and name.startswith("kiln_native_") else ""


def native_form(kernel: Kernel | None, codes: torch.Tensor) -> tuple[str, torch.Tensor | None]:
    """("namespace::op", form) for a kernel that multiplies a form of these codes' weight of its own with a native
    op(x, form, outputs) (its `native_form(codes)`, kiln.kernels.compute_forms); ("", None) for any other."""
    form_of = getattr(kernel, "native_form", None)
    return form_of(codes) if form_of is not None else ("", None)


def bind_kernels(codes: torch.Tensor, kernels: dict[int, Kernel]) -> None:
    """Run `kernels` (by row class) for every product over these codes. The binding dies with the codes."""
    entries = _BOUND.bind(codes, kernels)
    forms = [native_form(kernel, codes) for kernel in entries]
    names = [form_op or native_op_name(kernel) for kernel, (form_op, _) in zip(entries, forms, strict=True)]
    for binder in _native_binders:
        binder(codes, names, [form for _, form in forms])


def bound_kernel(codes: torch.Tensor, rows: int) -> Kernel:
    """The kernel bound to these codes for `rows` rows; the dequantize-then-BLAS reference when none is."""
    kernel = _BOUND.get(codes, rows)
    return dequant_blas if kernel is None else kernel


def unpack_codes(codes: torch.Tensor) -> torch.Tensor:
    """[..., group] integer codes: nibble pairs (uint8) unpacked, int8 codes as they are."""
    if codes.dtype == torch.uint8:
        return torch.cat([codes & 15, codes >> 4], dim=-1)
    return codes


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """`code * scale + offset` per group: [rows, groups, group] in the scale's dtype."""
    return unpack_codes(codes).to(scale.dtype) * scale + offset


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
    return bound_kernel(codes, x.shape[0])(x, codes, scale, offset)


_LIB.impl("packed_linear", packed_linear, "CompositeExplicitAutograd")
# the same implementation under another name: what the C++ kernel calls for bindings that are not native ops
_LIB.define("packed_linear_bound(Tensor x, Tensor codes, Tensor scale, Tensor offset) -> Tensor")
_LIB.impl("packed_linear_bound", packed_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("kiln::packed_linear", lib=_LIB)
def _(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], codes.shape[0])


@torch.library.register_fake("kiln::packed_linear_bound", lib=_LIB)
def _(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], codes.shape[0])
