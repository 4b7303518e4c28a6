"""`EagerExecutor`: the model's own forward, op by op, with the one-row layouts that time fastest here.

On CPU, batch-1 decode is bound by how fast one-row products stream the weights, and BLAS streams a row-major
and a column-major weight at different speeds depending on the machine. At `prepare` the executor times both
layouts for the largest decoder weight and for the logits head, keeps the faster for the decoder layers, and,
when the column-major head wins, keeps a transposed copy of the head for one-row logits (more rows use the
plain head, which is faster for them). `keep_layout=True` (the debugger's eager reference) changes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from kiln.executor.base import Executor
from kiln.executor.layout import COLUMN_MAJOR, fastest_one_row_layout, set_layer_weight_layout, with_layout
from kiln.model.forward_context import ModelInputs

logger = logging.getLogger("kiln")


class EagerExecutor(Executor):
    name = "eager"

    def __init__(self, keep_layout: bool = False) -> None:
        super().__init__()
        self.keep_layout = keep_layout
        self.layout_times: dict[str, dict[str, float]] = {}  # weight -> layout -> µs, as timed at prepare
        self._model: nn.Module | None = None
        self._head_t: torch.Tensor | None = None  # [hidden, vocab] copy of the head, when one-row logits gain

    def prepare(self, model: nn.Module, kv_caches: list[torch.Tensor]) -> None:
        self._model = model
        if self.keep_layout or next(model.parameters()).device.type != "cpu":
            return
        largest = max((m.weight for m in model.model.layers[0].modules() if isinstance(m, nn.Linear)), key=torch.numel)
        layer_layout, self.layout_times["decoder"] = fastest_one_row_layout(largest)
        head_layout, self.layout_times["lm_head"] = fastest_one_row_layout(model.lm_head.weight)
        set_layer_weight_layout(model, layer_layout)
        if head_layout == COLUMN_MAJOR:
            self._head_t = with_layout(model.lm_head.weight.detach(), COLUMN_MAJOR).t()
        logger.info(
            "Eager CPU layouts (timed for one row): decoder weights %s, logits head %s",
            layer_layout,
            head_layout,
        )

    def forward(self, batch: ModelInputs) -> torch.Tensor:
        assert self._model is not None, "EagerExecutor.prepare was not called"
        return self._model(batch.input_ids, batch.positions)

    def compute_logits(self, hidden: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        assert self._model is not None, "EagerExecutor.prepare was not called"
        hidden = hidden[list(rows)]
        if hidden.shape[0] == 1 and self._head_t is not None:
            return (hidden @ self._head_t).float()
        return self._model.compute_logits(hidden)
