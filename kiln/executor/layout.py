"""Weight layouts for one-row products, chosen by timing on this machine.

A decoder weight W [out, in] can be stored row-major (the plain layout) or column-major (a transposed view of a
contiguous [in, out] copy): shapes, names and values are the same, only strides differ, so every consumer of the
model still works. Which layout streams faster through BLAS for one row differs from CPU to CPU (MKL's fp32 GEMV
ran ~1.7x faster column-major on one 2-core AVX-512 box and not on another), so `fastest_one_row_layout` times
both at start-up and the eager executor keeps the winner. The embedding stays row-major (lookups gather rows).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import nn

logger = logging.getLogger("kiln")

ROW_MAJOR, COLUMN_MAJOR = "row-major", "column-major"


def is_column_major(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.t().is_contiguous() and not weight.is_contiguous()


def with_layout(weight: torch.Tensor, layout: str) -> torch.Tensor:
    """`weight` (same values) stored in `layout`; the tensor itself when it already is."""
    if layout == COLUMN_MAJOR:
        return weight if is_column_major(weight) else weight.t().contiguous().t()
    return weight if weight.is_contiguous() else weight.contiguous()


def set_layer_weight_layout(model: nn.Module, layout: str) -> bool:
    """Store every decoder layer's linear weights in `layout`; True when some weight changed."""
    changed = False
    for layer in model.model.layers:
        for module in layer.modules():
            if isinstance(module, nn.Linear):
                new = with_layout(module.weight.data, layout)
                if new is not module.weight.data:
                    module.weight.data = new
                    changed = True
    return changed


def fastest_one_row_layout(weight: torch.Tensor, repeats: int = 5) -> tuple[str, dict[str, float]]:
    """Time `x @ W.T` for one row with W row-major and column-major; the faster layout and the times (µs)."""
    x = torch.randn(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
    times = {}
    for layout in (ROW_MAJOR, COLUMN_MAJOR):
        w = with_layout(weight, layout)
        times[layout] = _best_us(lambda w=w: torch.nn.functional.linear(x, w), repeats)
    return min(times, key=times.__getitem__), times


def _best_us(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    fn()  # warm-up: first-call allocations
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e6
