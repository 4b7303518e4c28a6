"""The ways to compute an unquantized float32 logits head's product, one `HeadCandidate` each in `HEAD_CANDIDATES`
(a new way is one subclass and one entry): the head as loaded, a bf16 copy on oneDNN's brgemm, an int8 (Q8_0) copy
on the packed layers' int8-activation kernels. Candidates that read a copy name its kind in `form` and share it
(`Forms`). kiln.kernels.head_forms times them per row class and binds the winners; its docstring states each candidate's
arithmetic, bytes and measured accuracy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from kiln.compile.compiler import PieceCompiler
from kiln.kernels.candidates import (
    AMX_CANDIDATES,
    BF16,
    CANDIDATES,
    FLOAT32,
    NATIVE_INT8,
    NATIVE_INT8_BLOCKED,
    NATIVE_INT8_STREAMED,
    NATIVE_INT8_WIDE,
    NATIVE_INT8X2,
    NATIVE_INT8X2_BLOCKED,
    NATIVE_INT8X2_STREAMED,
    NATIVE_INT8X2_WIDE,
    PackedCandidate,
)
from kiln.kernels.compute_forms import bf16_form_bytes, brgemm_bf16_op, pack_dense_bf16
from kiln.kernels.layout import COLUMN_MAJOR, with_layout
from kiln.kernels.torch_kernels import layer_weight
from kiln.quant.linear import PackedLinear
from kiln.quant.ops import GEMV_ROWS, Kernel
from kiln.quant.quantize import quantize

Q8_GROUP = 32  # the int8 copy's group of inputs per scale (GGUF's Q8_0 block)
HeadKernel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x, head weight) -> float32 logits


class HeadCandidate(ABC):
    """One way to compute the head's product. `make(weights, rows, column_major, form)` builds the kernel for `rows`
    rows, called as `kernel(x, weight)` on any of `weights` (the race's copies, or the head weight at install);
    a candidate whose kernel reads a copy of the weight names the copy's kind in `form` and builds it in
    `make_form(weights)`: candidates of one form share one copy (`Forms`)."""

    name: str
    activations: str = FLOAT32
    form: str | None = None  # the kind of copy of the weight its kernel reads (bytes: copy_bytes); None: none

    @property
    def second_form(self) -> bool:
        return self.form is not None

    def runs(self, weight: torch.Tensor) -> bool:
        return True

    def applies(self, rows: int) -> bool:
        """Whether it is timed at `rows` rows (where it `runs`)."""
        return True

    def copy_bytes(self, weight: torch.Tensor) -> int:
        return 0

    def make_form(self, weights: list[torch.Tensor]) -> Any:
        """The copy of `weights` its kernels read (called only where `form` names one)."""
        return None

    @abstractmethod
    def make(self, weights: list[torch.Tensor], rows: int, column_major: bool, form: Any) -> HeadKernel: ...


class Forms:
    """The copies made of a list of weights, one per form: the kernels of every candidate and row count of one form
    read the same copy."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        self.weights = weights
        self.made: dict[str, Any] = {}

    def kernel(self, candidate: HeadCandidate, rows: int, column_major: bool) -> HeadKernel:
        form = None
        if candidate.form is not None:
            if candidate.form not in self.made:
                self.made[candidate.form] = candidate.make_form(self.weights)
            form = self.made[candidate.form]
        return candidate.make(self.weights, rows, column_major, form)


class AsLoaded(HeadCandidate):
    name = "as-loaded"

    def make(self, weights: list[torch.Tensor], rows: int, column_major: bool, form: Any) -> HeadKernel:
        if rows != 1 or not column_major:
            return nn.functional.linear
        transposed = {w.data_ptr(): with_layout(w, COLUMN_MAJOR).t() for w in weights}  # as the plan's head_t
        return lambda x, weight: x @ transposed[weight.data_ptr()]


class Bf16Head:
    """The bf16 brgemm product over its own copy of each weight it was made for, float32 logits."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        op = brgemm_bf16_op()
        if op is None:
            raise RuntimeError("the bf16 brgemm product does not load here (kiln.kernels.native)")
        self.op = op
        self.copies = {w.data_ptr(): pack_dense_bf16(w.detach()) for w in weights}

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.op(x.float(), self.copies[weight.data_ptr()], weight.shape[0])


class BrgemmBf16Head(HeadCandidate):
    name = "brgemm-bf16"
    activations = BF16
    form = "bf16"

    def runs(self, weight: torch.Tensor) -> bool:
        return weight.device.type == "cpu" and weight.shape[1] % 2 == 0 and brgemm_bf16_op() is not None

    def copy_bytes(self, weight: torch.Tensor) -> int:
        return bf16_form_bytes(weight.shape[0], weight.shape[1])

    def make_form(self, weights: list[torch.Tensor]) -> Bf16Head:
        return Bf16Head(weights)

    def make(self, weights: list[torch.Tensor], rows: int, column_major: bool, form: Any) -> HeadKernel:
        return cast(Bf16Head, form)


def q8_copy(weight: torch.Tensor) -> PackedLinear:
    """`weight` requantized as the packed layers hold an int8 weight (kiln.quant.quantize: int8 codes per group of
    Q8_GROUP inputs, a float32 scale per group; GGUF's Q8_0)."""
    out_features, in_features = weight.shape
    layer = PackedLinear(in_features, out_features, scheme="int8", bits=8, group=Q8_GROUP)
    layer.load_rows(0, quantize(weight.detach(), "int8", Q8_GROUP))
    return layer


class Q8Copies:
    """The int8 copy of each weight it was made for (`q8_copy`)."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        self.layers = {w.data_ptr(): q8_copy(w) for w in weights}

    def __call__(self, weight: torch.Tensor) -> PackedLinear:
        return self.layers[weight.data_ptr()]


class Q8Head(HeadCandidate):
    """The head's int8 copy (`q8_copy`) multiplied by one of the packed layers' int8-activation kernels
    (kiln.kernels.candidates: `packed`, timed where it applies to a Q8_GROUP-group int8 layout): the arithmetic and
    the bytes of a GGUF Q8_0 head (the Q4_1 default model's)."""

    form = "q8"

    def __init__(self, packed: PackedCandidate) -> None:
        self.packed = packed
        self.name = f"q8-{packed.name}"
        self.activations = packed.activations
        self.layout = PackedLinear(Q8_GROUP, 1, scheme="int8", bits=8, group=Q8_GROUP)  # the copy's layout, 1 row

    def runs(self, weight: torch.Tensor) -> bool:
        on_cpu = weight.device.type == "cpu" and weight.shape[1] % Q8_GROUP == 0
        return on_cpu and any(self.applies(rows) for rows in (1, GEMV_ROWS + 1))

    def applies(self, rows: int) -> bool:
        return self.packed.applies(self.layout, rows)

    def copy_bytes(self, weight: torch.Tensor) -> int:
        out_features, in_features = weight.shape
        return out_features * in_features + 2 * out_features * (in_features // Q8_GROUP) * 4  # codes, scale, offset

    def make_form(self, weights: list[torch.Tensor]) -> Q8Copies:
        return Q8Copies(weights)

    def make(self, weights: list[torch.Tensor], rows: int, column_major: bool, form: Any) -> HeadKernel:
        op = self.packed.make(self.layout, rows, compiler=cast(PieceCompiler, None), weights=[])  # a native op
        return Q8Product(op, cast(Q8Copies, form))


class Q8Product:
    """A packed int8-activation op over the int8 copy of the weight it is called with; float32 logits."""

    def __init__(self, op: Kernel, copies: Q8Copies) -> None:
        self.op, self.copies = op, copies

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.op(x.float().contiguous(), *layer_weight(self.copies(weight)))


Q8_PACKED = (
    NATIVE_INT8,
    NATIVE_INT8X2,
    NATIVE_INT8_STREAMED,
    NATIVE_INT8X2_STREAMED,
    NATIVE_INT8_WIDE,
    NATIVE_INT8X2_WIDE,
    NATIVE_INT8_BLOCKED,
    NATIVE_INT8X2_BLOCKED,
    *AMX_CANDIDATES,
)
HEAD_CANDIDATES: dict[str, HeadCandidate] = {
    c.name: c for c in (AsLoaded(), BrgemmBf16Head(), *(Q8Head(CANDIDATES[name]) for name in Q8_PACKED))
}
AS_LOADED, BRGEMM_BF16_HEAD = AsLoaded.name, BrgemmBf16Head.name
Q8_AMX_HEADS = tuple(f"q8-{name}" for name in AMX_CANDIDATES)
