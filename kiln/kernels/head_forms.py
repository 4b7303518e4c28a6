"""Second forms of an unquantized float32 logits head, chosen by timing (issue 55).

A quantized checkpoint often leaves its logits head unquantized (compressed-tensors' `ignore: [lm_head]`; a tied head
is the float32 embedding table): on the default model that head is 49152x576 float32, 113 MB read for every decode
step, four times the Q8_0 head of the GGUF the checkpoint was made from. The candidates (kiln.kernels.head_kernels)
compute the head's product in a form that reads fewer bytes, beside the weight as loaded, and are timed against it
per row class (kiln.kernels.packed's ROWS up to the head's rows, fewest first, kiln.kernels.race):
- `as-loaded`: the model's own head, `F.linear` over the float32 weight (one row: the column-major copy, where the
  plan's layout choice made one, kiln.kernels.layout); the reference, holds nothing;
- `brgemm-bf16`: a bf16 copy of the weight in oneDNN's VNNI order (kiln.kernels.compute_forms, 56 MB on the default
  model) times x rounded to bf16, summed and written in float32 by oneDNN's brgemm ukernel (the matrix unit where
  there is one). The arithmetic of the packed layers' bf16 second form, so admitted where the engine's activations
  admit it (int8 and int8x2, kiln.kernels.candidates.ADMITS), where second forms are allowed (a budget above zero)
  and where the matrix unit's probe passed.
- `q8-<packed candidate>`: an int8 copy of the weight (int8 codes per group of 32 inputs and a float32 scale per
  group, GGUF's Q8_0: 35 MB on the default model) multiplied by one of the packed layers' int8-activation kernels
  (kiln.kernels.candidates: the lane, streamed, wide, blocked and AMX-INT8 forms, each timed at the row counts it
  applies to), x quantized to the engine's own int8 digits: the bytes and the arithmetic of the Q4_1 GGUF's Q8_0 head.
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
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from kiln.kernels.candidates import ADMITS, BF16, FLOAT32
from kiln.kernels.choices import KernelChoiceCache, stream_count
from kiln.kernels.compute_forms import amx_int8_works, matrix_unit_works
from kiln.kernels.head_kernels import (
    AS_LOADED,
    HEAD_CANDIDATES,
    Q8_AMX_HEADS,
    Bf16Head,
    Forms,
    HeadCandidate,
    HeadKernel,
)
from kiln.kernels.native.build import source_hash
from kiln.kernels.race import RULES, Entrant, time_candidates
from kiln.quant.ops import row_class, rows_label

logger = logging.getLogger("kiln")

STREAM_BYTES = 96 << 20


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

    def bf16_copy(self, rows: int) -> torch.Tensor | None:
        """The head's bf16 copy in oneDNN's VNNI order where `rows` rows run the bf16 brgemm form (None otherwise)."""
        kernel = self.kernels.get(row_class(rows))
        return kernel.copies[self.weight.data_ptr()] if isinstance(kernel, Bf16Head) else None

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
