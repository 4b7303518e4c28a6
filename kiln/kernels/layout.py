"""Weight layouts for one-row products, chosen by timing on this machine (and cached, kiln.kernels.choices).

A decoder weight W [out, in] can be stored row-major (the plain layout) or column-major (a transposed view of a
contiguous [in, out] copy): shapes, names and values are the same, only strides differ, so every consumer of the
model still works. Which layout BLAS streams faster for one row differs from CPU to CPU (MKL's fp32 GEMV ran
~1.7x faster column-major on one 2-core AVX-512 box and not on another), so the kernel plan (kiln.kernels.plan)
times both. The same holds for the logits head, where the column-major form is a [hidden, vocab] copy used for
one-row logits only. The embedding stays row-major (lookups gather rows).
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.kernels.choices import KernelChoiceCache, streamed_copies, time_per_call_us

ROW_MAJOR, COLUMN_MAJOR = "row-major", "column-major"
LAYOUTS = (ROW_MAJOR, COLUMN_MAJOR)


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


def largest_layer_weight(model: nn.Module) -> torch.Tensor | None:
    """The decoder's largest float linear weight: the one that dominates a one-row decode step; None when every
    decoder weight is packed (kiln.quant), which has no layout to choose."""
    weights = [m.weight for m in model.model.layers[0].modules() if isinstance(m, nn.Linear)]
    return max(weights, key=torch.numel) if weights else None


def weight_key(weight: torch.Tensor) -> dict[str, object]:
    return {"shape": list(weight.shape), "dtype": str(weight.dtype).removeprefix("torch.")}


def fastest_one_row_layout(weight: torch.Tensor, cache: KernelChoiceCache, rows: int = 1) -> dict[str, object]:
    """Which layout streams `weight` faster through `F.linear` for `rows` rows: {"winner", "times_us", "source"}."""

    def measure() -> dict[str, object]:
        x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
        times = {}
        for layout in LAYOUTS:
            copies = streamed_copies(weight, lambda w, layout=layout: with_layout(w, layout))
            times[layout] = round(time_per_call_us(lambda w: torch.nn.functional.linear(x, w), copies), 2)
        return {"winner": min(times, key=times.__getitem__), "times_us": times}

    return cache.choose(f"linear_layout_rows{rows}", weight_key(weight), measure)


def one_row_head(head_weight: torch.Tensor, cache: KernelChoiceCache) -> tuple[torch.Tensor | None, dict[str, object]]:
    """A [hidden, vocab] copy of the logits head when one-row logits stream it faster that way (else None),
    and the timed choice."""
    choice = fastest_one_row_layout(head_weight, cache)
    if choice["winner"] != COLUMN_MAJOR:
        return None, choice
    return with_layout(head_weight.detach(), COLUMN_MAJOR).t(), choice
