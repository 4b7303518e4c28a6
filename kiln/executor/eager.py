"""`EagerExecutor`: the model's own forward, op by op, with the kernel plan timed fastest here.

On CPU, batch-1 decode is bound by how fast one-row products stream the weights, and BLAS streams a row-major
and a column-major weight at different speeds depending on the machine. At `prepare` the executor makes the
engine's kernel plan (kiln.kernels.plan, with no static compile sizes): the decoder layout, the one-row logits
head and the packed products' kernels, timed once per machine and process. `keep_layout=True` (the debugger's
eager reference) makes no plan and changes nothing; its packed layers run the kernels bound to them (by the
graph engine over the same model), the dequantize-then-BLAS reference where none is.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from kiln.config import DEFAULT_ACTIVATIONS, default_cache_dir
from kiln.executor.base import Executor
from kiln.kernels.head import LogitsHead, RowScores
from kiln.kernels.plan import KernelPlan, plan_kernels
from kiln.model.forward_context import ModelInputs

logger = logging.getLogger("kiln")


class EagerExecutor(Executor):
    name = "eager"

    def __init__(
        self,
        cache_dir: str | None = None,
        keep_layout: bool = False,
        activations: str = DEFAULT_ACTIVATIONS,
        head_rows: int | None = None,
        second_form_gb: float | None = None,
    ) -> None:
        super().__init__()
        self.head_rows = head_rows  # the most rows a step samples (None: no bound; kiln.kernels.plan)
        self.second_form_gb = second_form_gb  # the memory second forms of packed weights may take (kiln.kernels.plan)
        self.keep_layout = keep_layout
        self.activations = activations
        self.cache_root = Path(cache_dir or default_cache_dir())
        self.plan = KernelPlan()
        self._model: nn.Module | None = None
        self._head: LogitsHead | None = None

    @property
    def kernel_choices(self) -> dict[str, dict[str, object]]:
        """What the plan timed (or read from the cache) at prepare."""
        return self.plan.choices

    def prepare(self, model: nn.Module, kv_caches: list[torch.Tensor]) -> None:
        self._model = model
        if not self.keep_layout:
            self.plan = plan_kernels(
                model,
                self.cache_root,
                activations=self.activations,
                kv_caches=kv_caches,
                head_rows=self.head_rows,
                second_form_gb=self.second_form_gb,
            )
            self.plan.install(model)
        self._head = LogitsHead(model, self.plan.head_t, forms=self.plan.head_forms)

    def forward(self, batch: ModelInputs) -> torch.Tensor:
        assert self._model is not None, "EagerExecutor.prepare was not called"
        return self._model(batch.input_ids, batch.positions)

    def score_rows(self, hidden: torch.Tensor, targets: torch.Tensor, timed_rows: int) -> RowScores | None:
        return None if self._head is None else self._head.score_rows(hidden, targets, timed_rows)

    def compute_logits(self, hidden: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        assert self._head is not None, "EagerExecutor.prepare was not called"
        return self._head(hidden, rows)
