"""`EagerExecutor`: the model's own forward, op by op, with the one-row layouts that time fastest here.

On CPU, batch-1 decode is bound by how fast one-row products stream the weights, and BLAS streams a row-major
and a column-major weight at different speeds depending on the machine. At `prepare` the executor times both
layouts (kiln.executor.layout; cached per machine) for the largest decoder weight and for the logits head, keeps
the faster for the decoder layers, and, when the column-major head wins, keeps a transposed copy of the head for
one-row logits (more rows use the plain head). Packed layers (kiln.quant) run the kernels their table timed
fastest here for each row count (kiln.compile.packed_kernels). `keep_layout=True` (the debugger's eager reference)
changes nothing; its packed layers run the kernels registered in this process for the op (kiln.quant.ops), the
dequantize-then-BLAS reference where none is.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from kiln.compile.compiler import make_compiler
from kiln.compile.packed_kernels import packed_layers, time_and_install
from kiln.env import read_env
from kiln.executor.base import Executor
from kiln.executor.kernel_choice import KernelChoiceCache
from kiln.executor.layout import fastest_one_row_layout, largest_layer_weight, one_row_head, set_layer_weight_layout
from kiln.model.forward_context import ModelInputs

logger = logging.getLogger("kiln")


class EagerExecutor(Executor):
    name = "eager"

    def __init__(self, cache_dir: str | None = None, keep_layout: bool = False) -> None:
        super().__init__()
        self.keep_layout = keep_layout
        self.cache_root = Path(cache_dir) if cache_dir else read_env().cache_dir
        self.kernel_choices: dict[str, dict[str, object]] = {}  # what was timed (or read from the cache) at prepare
        self._model: nn.Module | None = None
        self._head_t: torch.Tensor | None = None  # [hidden, vocab] copy of the head, when one-row logits gain

    def prepare(self, model: nn.Module, kv_caches: list[torch.Tensor]) -> None:
        self._model = model
        if self.keep_layout or next(model.parameters()).device.type != "cpu":
            return
        cache = KernelChoiceCache(self.cache_root)
        if packed_layers(model):
            self.kernel_choices["packed_kernels"] = time_and_install(model, make_compiler("inductor"), cache)
        weight = largest_layer_weight(model)
        if weight is not None:
            decoder = fastest_one_row_layout(weight, cache)
            set_layer_weight_layout(model, str(decoder["winner"]))
            self.kernel_choices["decoder"] = decoder
        if isinstance(model.lm_head, nn.Linear):
            self._head_t, self.kernel_choices["lm_head"] = one_row_head(model.lm_head.weight, cache)
        layouts = {k: v for k, v in self.kernel_choices.items() if k in ("decoder", "lm_head")}
        if layouts:
            logger.info(
                "Eager CPU layouts for one row (%s): %s",
                "timed" if any(c["source"] == "timed" for c in layouts.values()) else "timed earlier on this machine",
                ", ".join(
                    f"{'decoder weights' if k == 'decoder' else 'logits head'} {c['winner']}"
                    for k, c in layouts.items()
                ),
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
