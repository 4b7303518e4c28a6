"""The ways a `LoRALinear` computes its adapters' products over the same static buffers, one `LoRAForm` each in
`FORMS` (a new form is one subclass and one entry). Every form computes, per token, `B[slot] @ (A[slot] @ x)` of the
token's own slot (zero for BASE_ONLY tokens), in float32 whatever the buffers' dtype is where it can:

- `stacked` (S-LoRA's batched product, for many rows): every token multiplies by every slot's stacked A in one GEMM
  and keeps its own slot's columns, then one GEMM per part multiplies by the stacked B. Work and bytes read grow with
  max_loras, which a decode step of few rows pays in full. Runs in the buffers' dtype (bf16 buffers: bf16 GEMMs).
- `gathered` (Punica's bgmv, for few rows): each token reads its own slot's A and B only, written as two reductions
  over the gathered weights (`(x * A[slot]).sum(-1)`), which inductor fuses into one loop each that never writes
  the gathered weights out; bf16 buffers are widened inside that loop. Its work grows with the rows times one slot.

The form of a step is picked by its rows (`LoRALinear.form_for`): an eager step knows them, a graph traced for a
symbolic row count takes the form of the rows it serves (kiln.lora.layer).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Protocol

import torch
from torch.nn import functional as F


class TokenSlots(Protocol):
    """The step's slot per token (kiln.lora.layer.TokenSlots)."""

    index: torch.Tensor


class LoRALinear(Protocol):
    """What a form reads of its layer (kiln.lora.layer.LoRALinear): its base, the static buffers and their shape."""

    base: torch.nn.Module
    tokens: TokenSlots
    in_features: int
    out_features: int
    max_loras: int
    max_rank: int
    parts: tuple[tuple[int, int], ...]
    block: int
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    column_slot: torch.Tensor


class LoRAForm(ABC):
    """`delta(layer, x)`: the adapters' output [rows, out_features] for `x` [rows, in_features] (in x's dtype), each
    token through the slot `layer.tokens.index` gives it; `forward(layer, x)`: the layer's output, its base's plus
    that (a form may compute both at once)."""

    name: ClassVar[str]
    # whether the form's work grows with the rows times one slot's weights at any row count (a prefill chunk too),
    # not only where few rows make that small
    any_rows: ClassVar[bool] = False

    @abstractmethod
    def delta(self, layer: LoRALinear, x: torch.Tensor) -> torch.Tensor: ...

    def forward(self, layer: LoRALinear, x: torch.Tensor) -> torch.Tensor:
        return layer.base(x) + self.delta(layer, x)


class StackedForm(LoRAForm):
    name = "stacked"

    def delta(self, layer: LoRALinear, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        shrunk = F.linear(x.to(layer.lora_a.dtype), layer.lora_a)
        shrunk = shrunk * (layer.tokens.index[:n, None] == layer.column_slot).to(shrunk.dtype)
        if len(layer.parts) == 1:
            return (shrunk @ layer.lora_b).to(x.dtype)
        expanded = [
            shrunk[:, i * layer.block : (i + 1) * layer.block] @ layer.lora_b[:, offset : offset + rows]
            for i, (offset, rows) in enumerate(layer.parts)
        ]
        return torch.cat(expanded, dim=-1).to(x.dtype)


class GatheredForm(LoRAForm):
    name = "gathered"

    def delta(self, layer: LoRALinear, x: torch.Tensor) -> torch.Tensor:
        n, parts, rank = x.shape[0], len(layer.parts), layer.max_rank
        slot = layer.tokens.index[:n]
        own = slot.clamp(min=0)  # BASE_ONLY tokens read slot 0 and keep none of it
        keep = (slot >= 0).to(torch.float32)
        # A's rows are (part, slot, rank): each token's own [parts, rank, in] block
        a = layer.lora_a.view(parts, layer.max_loras, rank, layer.in_features)[:, own].to(torch.float32)
        shrunk = (x.to(torch.float32)[None, :, None, :] * a).sum(-1) * keep[None, :, None]  # [parts, n, rank]
        b = layer.lora_b.view(layer.max_loras, rank, layer.out_features)[own].to(torch.float32)  # [n, rank, out]
        expanded = [
            (shrunk[i][:, :, None] * b[:, :, offset : offset + rows]).sum(1)
            for i, (offset, rows) in enumerate(layer.parts)
        ]
        return torch.cat(expanded, dim=-1).to(x.dtype)


FORMS: dict[str, LoRAForm] = {f.name: f for f in (StackedForm(), GatheredForm())}
STACKED, GATHERED = StackedForm.name, GatheredForm.name
