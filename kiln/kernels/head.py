"""`LogitsHead`: fp32 logits for the sampled rows, one row the fastest way the kernel plan found; and for prompt
logprobs, the numbers they keep of many rows without the logits where the head runs a bf16 brgemm form
(`score_rows`: kiln's native `head_row_scores`, kiln/kernels/native/head_scores.cpp).

Batch-1 decode streams the whole head (the largest single weight) for one row, so one row gets its own path: the
head compiled for one static row (a GEMV reduction, when the plan picked static size 1) or a [hidden, vocab]
copy of the head (when BLAS streams the column-major form faster here); more rows use the model's own head. A
float32 head's second form (kiln.kernels.head_forms) runs the row classes where the plan bound it, before either.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import nn

from kiln.kernels.candidates import widest_native
from kiln.kernels.compute_forms import brgemm_bf16_op
from kiln.kernels.head_forms import HeadFormTable
from kiln.kernels.product import CompiledProduct
from kiln.quant.linear import PackedLinear
from kiln.quant.ops import bound_kernel, native_form

# of each row: its logsumexp, its target's logit and rank (1 + the logits above it), its largest logit and index
RowScores = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@functools.cache
def native_head_scores() -> Callable[..., RowScores] | None:
    """The native `head_row_scores` op (the avx512 tier's: it multiplies on oneDNN's brgemm), None where it does not
    build or the CPU lacks the tier."""
    return widest_native("head_row_scores")


class LogitsHead:
    def __init__(
        self,
        model: nn.Module,
        head_t: torch.Tensor | None = None,
        compiled: CompiledProduct | None = None,
        forms: HeadFormTable | None = None,
    ) -> None:
        self.model = model
        self.head_t = head_t  # [hidden, vocab]
        self.compiled = compiled  # the head compiled for one static row
        self.forms = forms  # a float32 head's second form, bound to the row classes it won

    def score_rows(self, hidden: torch.Tensor, targets: torch.Tensor, timed_rows: int) -> RowScores | None:
        """`prompt_row_scores(self(hidden, all rows), targets)` (kiln.engine.running.prompt_logprobs) without the
        logits, where the head's row class of `timed_rows` rows (the largest its kernels were timed for) runs the bf16
        brgemm form and the native op loads; None otherwise (the caller computes the logits and scores them)."""
        op = native_head_scores() if hidden.device.type == "cpu" else None
        form = self.bf16_form(timed_rows) if op is not None else None
        if op is None or form is None:
            return None
        copy, outputs = form
        return op(hidden.float().contiguous(), copy, outputs, targets)

    def bf16_form(self, rows: int) -> tuple[torch.Tensor, int] | None:
        """The head's bf16 copy in oneDNN's VNNI order (kiln.kernels.compute_forms) and its outputs, where `rows`
        rows multiply it on the bf16 brgemm: a float32 head's second form, or a packed head's bound kernel."""
        if self.forms is not None:
            copy = self.forms.bf16_copy(rows)
            return (copy, self.forms.weight.shape[0]) if copy is not None else None
        head = getattr(self.model, "lm_head", None)
        brgemm = brgemm_bf16_op()
        if not isinstance(head, PackedLinear) or brgemm is None:
            return None
        op, copy = native_form(bound_kernel(head.codes, rows), head.codes)
        return (copy, head.out_features) if copy is not None and op == brgemm._qualified_op_name else None

    def __call__(self, hidden: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        hidden = hidden[list(rows)]
        form = None if self.forms is None else self.forms.kernel(hidden.shape[0])
        if form is not None:
            return form(hidden)
        if hidden.shape[0] == 1:
            if self.compiled is not None:
                return self.compiled(hidden)
            if self.head_t is not None:
                return (hidden @ self.head_t).float()
        return self.model.compute_logits(hidden)
