"""`LogitsHead`: fp32 logits for the sampled rows, one row the fastest way the kernel plan found.

Batch-1 decode streams the whole head (the largest single weight) for one row, so one row gets its own path: the
head compiled for one static row (a GEMV reduction, when the plan picked static size 1) or a [hidden, vocab]
copy of the head (when BLAS streams the column-major form faster here); more rows use the model's own head. A
float32 head's second form (kiln.kernels.head_forms) runs the row classes where the plan bound it, before either.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from kiln.kernels.head_forms import HeadFormTable
from kiln.kernels.product import CompiledProduct


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
