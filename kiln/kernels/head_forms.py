"""Second forms of an unquantized float32 logits head, chosen by timing (issue 55).

A quantized checkpoint often leaves its logits head unquantized (compressed-tensors' `ignore: [lm_head]`; a tied head
is the float32 embedding table): on the default model that head is 49152x576 float32, 113 MB read for every decode
step, four times the Q8_0 head of the GGUF the checkpoint was made from. The candidates here compute the head's
product in a form that reads fewer bytes, beside the weight as loaded, and are timed against it per row class
(kiln.kernels.packed's ROWS up to the head's rows, fewest first, kiln.kernels.race):
- `as-loaded`: the model's own head, `F.linear` over the float32 weight (one row: the column-major copy, where the
  plan's layout choice made one, kiln.kernels.layout); the reference, holds nothing;
- `brgemm-bf16`: a bf16 copy of the weight in oneDNN's VNNI order (kiln.kernels.compute_forms, 56 MB on the default
  model) times x rounded to bf16, summed and written in float32 by oneDNN's brgemm ukernel (the matrix unit where
  there is one). The arithmetic of the packed layers' bf16 second form, so admitted where the engine's activations
  admit it (int8 and int8x2, kiln.kernels.candidates.ADMITS), where second forms are allowed (a budget above zero)
  and where the matrix unit's probe passed.
- `q8-<packed candidate>`: an int8 copy of the weight (int8 codes per group of 32 inputs and a float32 scale per
  group, GGUF's Q8_0: 35 MB on the default model) multiplied by one of the packed layers' int8-activation kernels
  (kiln.kernels.candidates: the lane, streamed, blocked and AMX-INT8 forms, each timed at the row counts it applies
  to), x quantized to the engine's own int8 digits: the bytes and the arithmetic of the Q4_1 GGUF's Q8_0 head.
  Admitted as the packed candidates are (int8 or int8x2 engines, the AMX forms where their probe passed) and where
  second forms are allowed.
Candidates of one form (the q8 ones) share one copy. The head weight itself is never changed: a tied embedding keeps
looking up the float32 table, and every other user of the head (prompt logprobs, the debugger) computes on it. Only
`LogitsHead` (kiln.kernels.head) runs a won form, for the row classes it won; the copies count against the engine's
budget for second forms (the form that won one row made first) and are logged. The table is
made for a head beside packed layers alone (kiln.kernels.plan): a float model's head computes as its user loaded it.

On the W4A16 default model (scripts/compress_w4a16.py, int8x2 activations) the bf16 head against the float32 one over
1,200 positions (the source of difflib, as tests/quant/test_int8_accuracy.py scores): mean KL 5.4e-5, top-1 99.25 %.
That head is the GGUF's dequantized Q8_0, which the int8 copy would read back exactly; against a float32 head moved off
that grid (tests/quant/test_int8_accuracy.py) the int8 copy scores mean KL 2.5e-4, top-1 99.08 % (bar 1e-3, 99 %).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from functools import partial
from typing import Any, cast

import torch
from torch import nn

from kiln.compile.compiler import PieceCompiler
from kiln.kernels.candidates import (
    ADMITS,
    AMX_CANDIDATES,
    BF16,
    CANDIDATES,
    FLOAT32,
    NATIVE_INT8,
    NATIVE_INT8_BLOCKED,
    NATIVE_INT8_STREAMED,
    NATIVE_INT8X2,
    NATIVE_INT8X2_BLOCKED,
    NATIVE_INT8X2_STREAMED,
    PackedCandidate,
)
from kiln.kernels.choices import KernelChoiceCache, stream_count
from kiln.kernels.compute_forms import (
    amx_int8_works,
    bf16_form_bytes,
    brgemm_bf16_op,
    matrix_unit_works,
    pack_dense_bf16,
)
from kiln.kernels.layout import COLUMN_MAJOR, with_layout
from kiln.kernels.native.build import source_hash
from kiln.kernels.race import RULES, Entrant, time_candidates
from kiln.kernels.torch_kernels import layer_weight
from kiln.quant.linear import PackedLinear
from kiln.quant.ops import GEMV_ROWS, Kernel, row_class, rows_label
from kiln.quant.quantize import quantize

logger = logging.getLogger("kiln")

STREAM_BYTES = 96 << 20
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
        raise NotImplementedError(f"{self.name} reads the weight as loaded: it has no form")

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
    NATIVE_INT8_BLOCKED,
    NATIVE_INT8X2_BLOCKED,
    *AMX_CANDIDATES,
)
HEAD_CANDIDATES: dict[str, HeadCandidate] = {
    c.name: c for c in (AsLoaded(), BrgemmBf16Head(), *(Q8Head(CANDIDATES[name]) for name in Q8_PACKED))
}
AS_LOADED, BRGEMM_BF16_HEAD = AsLoaded.name, BrgemmBf16Head.name
Q8_AMX_HEADS = tuple(f"q8-{name}" for name in AMX_CANDIDATES)


def head_candidates(
    weight: torch.Tensor, activations: str, second_forms: bool, cache: KernelChoiceCache
) -> dict[str, HeadCandidate]:
    """The candidates timed for this head: those that run here, whose arithmetic the engine's activations admit,
    holding a second form only where second forms are allowed; a bf16 one only where the matrix unit's probe
    passed, an AMX-INT8 one only where the tiles' probe passed (kiln.kernels.compute_forms)."""
    admitted = ADMITS.get(activations, (FLOAT32, activations))
    chosen = {
        name: c
        for name, c in HEAD_CANDIDATES.items()
        if c.activations in admitted and (second_forms or not c.second_form) and c.runs(weight)
    }
    if any(c.activations == BF16 for c in chosen.values()) and not matrix_unit_works(cache):
        chosen = {name: c for name, c in chosen.items() if c.activations != BF16}
    if any(name in Q8_AMX_HEADS for name in chosen) and not amx_int8_works(cache):
        chosen = {name: c for name, c in chosen.items() if name not in Q8_AMX_HEADS}
    return chosen


def float_head(model: nn.Module) -> nn.Linear | None:
    """The model's logits head when it is a plain float32 `nn.Linear` on the CPU (the forms here apply), else None."""
    head = getattr(model, "lm_head", None)
    if type(head) is not nn.Linear or head.weight.dtype != torch.float32 or head.weight.device.type != "cpu":
        return None
    return head


class HeadFormTable:
    """Timed choices for a float32 logits head (its row classes); `install` makes the won forms' copies."""

    def __init__(
        self,
        model: nn.Module,
        cache: KernelChoiceCache,
        rows: tuple[int, ...],
        candidates: dict[str, HeadCandidate],
        column_major: bool = False,
    ) -> None:
        """`rows`: the row counts timed (one per row class); `column_major`: the plan keeps a column-major copy
        for one-row logits, which `as-loaded` then runs at one row."""
        head = float_head(model)
        if head is None:
            raise ValueError("HeadFormTable: the model's lm_head is not a float32 nn.Linear on the CPU")
        self.weight = head.weight
        self.tied = head.weight is getattr(model.model.embed_tokens, "weight", None)
        self.rows = rows
        self.candidates = candidates
        self.kernels: dict[int, HeadKernel] = {}  # row class -> the won form's kernel (bound at install)
        self.made: dict[str, int] = {}  # form -> the bytes of its copy (made at install)
        self.row_forms: dict[int, str] = {}  # row class -> the form its kernel reads (bound at install)
        self.over_budget = False
        key = {
            "shape": list(self.weight.shape),
            "dtype": "float32",
            "rows": list(rows),
            "column_major": column_major,
            "candidates": sorted(candidates),
            "native": source_hash() if any(c.second_form for c in candidates.values()) else None,
            "race": RULES,
        }
        measure = partial(_time, self.weight, rows_timed=rows, candidates=candidates, column_major=column_major)
        self.record = cache.choose("head_forms", key, measure)

    def winners(self) -> dict[int, str]:
        """Row count timed -> the candidate that won it (the reference where it was not timed)."""
        won = self.record["winners"]
        return {rows: str(won.get(str(rows), AS_LOADED)) for rows in self.rows}

    def install(self, budget_bytes: float | None = None) -> int:
        """Make the copy of each won second form where it fits `budget_bytes` (None: no bound), the form that won
        one row first, then by the row classes it won, and bind its kernels to those row classes (a row class whose
        form did not fit runs the head as loaded); the bytes of the copies made."""
        won = {rows: HEAD_CANDIDATES[name] for rows, name in self.winners().items()}
        self.kernels, self.made, self.over_budget, self.row_forms = {}, {}, False, {}
        by_form: dict[str, list[int]] = {}
        for rows, candidate in won.items():
            if candidate.form is not None:
                by_form.setdefault(candidate.form, []).append(rows)
        forms, left = Forms([self.weight]), budget_bytes
        for form, rows_won in sorted(by_form.items(), key=lambda item: (1 not in item[1], -len(item[1]))):
            need = won[rows_won[0]].copy_bytes(self.weight)
            if left is not None and need > left:
                self.over_budget = True
                continue
            for rows in rows_won:
                self.kernels[row_class(rows)] = forms.kernel(won[rows], rows, column_major=False)
                self.row_forms[row_class(rows)] = form
            self.made[form] = need
            left = None if left is None else left - need
        return sum(self.made.values())

    @property
    def form(self) -> str | None:
        """The forms whose copies were made (None: none)."""
        return " and ".join(self.made) or None

    def one_row_bytes(self) -> int | None:
        """The bytes a one-row product reads where a form is bound to one row (its copy), None where the head as
        loaded runs it."""
        form = self.row_forms.get(row_class(1))
        return None if form is None else self.made[form]

    def kernel(self, rows: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The bound form's product for `rows` rows (None: the head as loaded runs)."""
        kernel = self.kernels.get(row_class(rows))
        return None if kernel is None else partial(kernel, weight=self.weight)

    def summary(self) -> str:
        """Which form runs which row classes of the head, and its bytes, for the start-up log."""
        shape = "x".join(str(d) for d in self.weight.shape)
        tied = ", tied to the embedding, whose lookups read the float32 table" if self.tied else ""
        rows = ", ".join(f"{rows_label(r)} {name}" for r, name in self.winners().items())
        if self.made:
            copies = ", ".join(f"{form} ({size / 2**20:.1f} MB)" for form, size in self.made.items())
            made = f"second form{'s' if len(self.made) > 1 else ''} {copies}"
            made += "; a form over the budget: its row classes run as loaded" if self.over_budget else ""
        elif self.over_budget:
            made = "its second form is over the budget: the head runs as loaded"
        else:
            made = "no second form"
        return f"lm_head {shape} float32{tied}: {rows}; {made}"


def _time(
    weight: torch.Tensor, rows_timed: tuple[int, ...], candidates: dict[str, HeadCandidate], column_major: bool
) -> dict[str, Any]:
    """Race the candidates at each row count, fewest rows first (a candidate's time at fewer rows is its floor at
    more, kiln.kernels.race); second forms are made over the streamed copies before their first call."""
    count = stream_count(weight.numel() * weight.element_size(), STREAM_BYTES)
    copies = [(weight.detach().clone(),) for _ in range(count)]
    weights = [w for (w,) in copies]
    times: dict[str, dict[str, float]] = {}
    winners: dict[str, str] = {}
    ruled_out: dict[str, dict[str, float]] = {}
    floors: dict[str, float] = {}
    forms = Forms(weights)  # a form's copies are made once for all its candidates and row counts

    for rows in rows_timed:
        x = torch.randn(rows, weight.shape[1])
        entrants = {
            name: Entrant(
                make=partial(forms.kernel, candidates[name], rows, column_major),
                floor=partial(_at_least, floors.get(name, 0.0)),
            )
            for name in sorted(candidates, key=lambda n: candidates[n].second_form)  # the reference first
            if candidates[name].applies(rows)
        }
        race = time_candidates(entrants, x, copies)
        times[str(rows)], winners[str(rows)] = race.times, race.winner
        if race.ruled_out:
            ruled_out[str(rows)] = race.ruled_out
        floors |= race.ruled_out | race.times
    return {"winners": winners, "times_us": times, "ruled_out_us": ruled_out}


def _at_least(least: float, times: dict[str, float]) -> float:
    return least
