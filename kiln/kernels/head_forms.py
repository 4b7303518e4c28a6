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
The head weight itself is never changed: a tied embedding keeps looking up the float32 table, and every other user of
the head (prompt logprobs, the debugger) computes on it. Only `LogitsHead` (kiln.kernels.head) runs a won form, for
the row classes it won; its bytes count against the engine's budget for second forms and are logged. The table is
made for a head beside packed layers alone (kiln.kernels.plan): a float model's head computes as its user loaded it.

On the W4A16 default model (scripts/compress_w4a16.py, int8x2 activations) the bf16 head against the float32 one over
1,200 positions (the source of difflib, as tests/quant/test_int8_accuracy.py scores): mean KL 5.4e-5, top-1 99.25 %.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from functools import partial
from typing import Any, ClassVar

import torch
from torch import nn

from kiln.kernels.candidates import ADMITS, BF16, FLOAT32
from kiln.kernels.choices import KernelChoiceCache, stream_count
from kiln.kernels.compute_forms import bf16_form_bytes, brgemm_bf16_op, matrix_unit_works, pack_dense_bf16
from kiln.kernels.layout import COLUMN_MAJOR, with_layout
from kiln.kernels.native.build import source_hash
from kiln.kernels.race import RULES, Entrant, time_candidates
from kiln.quant.ops import row_class, rows_label

logger = logging.getLogger("kiln")

STREAM_BYTES = 96 << 20
HeadKernel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x, head weight) -> float32 logits


class HeadCandidate(ABC):
    """One way to compute the head's product. `make(weights, rows)` builds the kernel over its own form of each of
    `weights` (the race's copies, or the head weight at install), called as `kernel(x, weight)`."""

    name: ClassVar[str]
    activations: ClassVar[str] = FLOAT32
    second_form: ClassVar[bool] = False  # its kernel holds a copy of the weight (bytes: copy_bytes)

    def runs(self, weight: torch.Tensor) -> bool:
        return True

    def copy_bytes(self, weight: torch.Tensor) -> int:
        return 0

    @abstractmethod
    def make(self, weights: list[torch.Tensor], rows: int, column_major: bool) -> HeadKernel: ...


class AsLoaded(HeadCandidate):
    name = "as-loaded"

    def make(self, weights: list[torch.Tensor], rows: int, column_major: bool) -> HeadKernel:
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
    second_form = True

    def runs(self, weight: torch.Tensor) -> bool:
        return weight.device.type == "cpu" and weight.shape[1] % 2 == 0 and brgemm_bf16_op() is not None

    def copy_bytes(self, weight: torch.Tensor) -> int:
        return bf16_form_bytes(weight.shape[0], weight.shape[1])

    def make(self, weights: list[torch.Tensor], rows: int, column_major: bool) -> HeadKernel:
        return Bf16Head(weights)


HEAD_CANDIDATES: dict[str, HeadCandidate] = {c.name: c for c in (AsLoaded(), BrgemmBf16Head())}
AS_LOADED, BRGEMM_BF16_HEAD = AsLoaded.name, BrgemmBf16Head.name


def head_candidates(
    weight: torch.Tensor, activations: str, second_forms: bool, cache: KernelChoiceCache
) -> dict[str, HeadCandidate]:
    """The candidates timed for this head: those that run here, whose arithmetic the engine's activations admit,
    holding a second form only where second forms are allowed; a bf16 one only where the matrix unit's probe
    passed (kiln.kernels.compute_forms)."""
    admitted = ADMITS.get(activations, (FLOAT32, activations))
    chosen = {
        name: c
        for name, c in HEAD_CANDIDATES.items()
        if c.activations in admitted and (second_forms or not c.second_form) and c.runs(weight)
    }
    if any(c.activations == BF16 for c in chosen.values()) and not matrix_unit_works(cache):
        chosen = {name: c for name, c in chosen.items() if c.activations != BF16}
    return chosen


def float_head(model: nn.Module) -> nn.Linear | None:
    """The model's logits head when it is a plain float32 `nn.Linear` on the CPU (the forms here apply), else None."""
    head = getattr(model, "lm_head", None)
    if type(head) is not nn.Linear or head.weight.dtype != torch.float32 or head.weight.device.type != "cpu":
        return None
    return head


class HeadFormTable:
    """Timed choices for a float32 logits head (its row classes); `install` makes the won form's copy."""

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
        self.form: str | None = None
        self.form_bytes = 0
        key = {
            "shape": list(self.weight.shape),
            "dtype": "float32",
            "rows": list(rows),
            "column_major": column_major,
            "candidates": sorted(candidates),
            "native": source_hash() if brgemm_bf16_op() is not None else None,
            "race": RULES,
        }
        measure = partial(_time, self.weight, rows_timed=rows, candidates=candidates, column_major=column_major)
        self.record = cache.choose("head_forms", key, measure)

    def winners(self) -> dict[int, str]:
        """Row count timed -> the candidate that won it (the reference where it was not timed)."""
        won = self.record["winners"]
        return {rows: str(won.get(str(rows), AS_LOADED)) for rows in self.rows}

    def install(self, budget_bytes: float | None = None) -> int:
        """Make the copy of the won second form (one for every row class it won) where it fits `budget_bytes`
        (None: no bound), and bind it to those row classes; the bytes of the copy made."""
        won = {rows: name for rows, name in self.winners().items() if HEAD_CANDIDATES[name].second_form}
        self.over_budget = False
        if not won:
            return 0
        name = next(iter(won.values()))  # (one second-form candidate: brgemm-bf16)
        candidate = HEAD_CANDIDATES[name]
        need = candidate.copy_bytes(self.weight)
        if budget_bytes is not None and need > budget_bytes:
            self.over_budget = True
            return 0
        kernel = candidate.make([self.weight], max(won), column_major=False)
        self.kernels = {row_class(rows): kernel for rows in won}
        self.form, self.form_bytes = name, need
        return need

    def kernel(self, rows: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The bound form's product for `rows` rows (None: the head as loaded runs)."""
        kernel = self.kernels.get(row_class(rows))
        return None if kernel is None else partial(kernel, weight=self.weight)

    def summary(self) -> str:
        """Which form runs which row classes of the head, and its bytes, for the start-up log."""
        shape = "x".join(str(d) for d in self.weight.shape)
        tied = ", tied to the embedding, whose lookups read the float32 table" if self.tied else ""
        rows = ", ".join(f"{rows_label(r)} {name}" for r, name in self.winners().items())
        if self.form is not None:
            made = f"second form {self.form} ({self.form_bytes / 2**20:.1f} MB)"
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
    made: dict[str, HeadKernel] = {}  # a form's copies are made once for all row counts

    def make(name: str, rows: int) -> HeadKernel:
        candidate = candidates[name]
        if not candidate.second_form:
            return candidate.make(weights, rows, column_major)
        if name not in made:
            made[name] = candidate.make(weights, rows, column_major)
        return made[name]

    for rows in rows_timed:
        x = torch.randn(rows, weight.shape[1])
        entrants = {
            name: Entrant(make=partial(make, name, rows), floor=partial(_at_least, floors.get(name, 0.0)))
            for name in sorted(candidates, key=lambda n: candidates[n].second_form)  # the reference first
        }
        race = time_candidates(entrants, x, copies)
        times[str(rows)], winners[str(rows)] = race.times, race.winner
        if race.ruled_out:
            ruled_out[str(rows)] = race.ruled_out
        floors |= race.ruled_out | race.times
    return {"winners": winners, "times_us": times, "ruled_out_us": ruled_out}


def _at_least(least: float, times: dict[str, float]) -> float:
    return least
