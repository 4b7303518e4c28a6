"""`Executor`: the one interface through which a step's forward runs, and the one owner of how it runs.

An executor owns everything that changes how the same model computes the same numbers faster: weight layouts,
the logits head, compiled pieces, captures, counters. `EngineCore` picks one from the config (a registry entry
in `kiln.engine.setup.build`) and hands it to `ModelRunner`; nothing else switches layouts or replaces forwards.

Rules:
- `prepare(model, kv_caches)` is called once, before any `forward`; it may change parameter *strides* (never
  shapes or values) and build whatever it runs (traces, compiles, captures) against those caches.
- `pad_to(n)` says how many tokens the runner must feed for `n` real ones; `forward` gets exactly that many,
  under a forward context whose metadata covers the real tokens (attention ignores the padding).
- `forward(batch)` returns hidden states for every fed token: [padded_num_tokens, hidden].
- `compute_logits(hidden, rows)` returns fp32 logits for `hidden[rows]`; `score_rows(hidden, targets, timed_rows)`
  what prompt logprobs keep of each row of `hidden`'s logits without making them, where the head can (else None).
- `plan` is the kernel plan `prepare` made and installed (kiln.kernels.plan; empty before it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
from torch import nn

from kiln.compile.counters import CompileCounters
from kiln.kernels.head import RowScores
from kiln.kernels.plan import KernelPlan
from kiln.model.forward_context import ModelInputs


class Executor(ABC):
    name: str

    def __init__(self) -> None:
        self.counters = CompileCounters()
        self.plan = KernelPlan()

    @abstractmethod
    def prepare(self, model: nn.Module, kv_caches: list[torch.Tensor]) -> None: ...

    @abstractmethod
    def forward(self, batch: ModelInputs) -> torch.Tensor: ...

    def pad_to(self, num_tokens: int) -> int:
        return num_tokens

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor, rows: Sequence[int]) -> torch.Tensor: ...

    def score_rows(self, hidden: torch.Tensor, targets: torch.Tensor, timed_rows: int) -> RowScores | None:
        """Each row of `hidden`'s logsumexp, target logit and rank, largest logit and index (kiln.kernels.head's
        `LogitsHead.score_rows`); None where this executor's head has no such path."""
        return None
