"""`LoRALinear`: a linear layer plus the batched LoRA products of every adapter slot, and `TokenSlots`, the step's
slot per token that they all read.

S-LoRA/Punica style, in one shape for every step: all slots' A matrices are stacked in one static buffer (and their
B matrices in another), so a step multiplies by every slot at once and keeps, per token, the columns of its own slot:

    shrunk = x @ A_all^T                    [tokens, parts * slots * rank]
    shrunk *= (slot[token] == column_slot)  zero but the token's own slot (-1: none, the base alone)
    out = base(x) + shrunk @ B_all^T        B_all [out, slots * rank] holds each slot's B * scale

A fused module (qkv_proj, gate_up_proj) has one block of A rows per part, and each part's output rows take the
product of their own block only (one expand per part, concatenated): B is never stored block-diagonal.
The products are plain `F.linear`s over buffers that the compiled pieces take as inputs by reference (kiln.compile
never freezes them), so loading an adapter is a copy into the buffers: nothing recompiles or recaptures. They are
not kiln.kernels candidates yet (a native shrink/expand kernel is not written): torch's GEMMs run them.
"""

from __future__ import annotations

from itertools import accumulate

import torch
from torch import nn
from torch.nn import functional as F

from kiln.lora.checkpoint import LoRALayer
from kiln.lora.config import LoRALimits
from kiln.lora.targets import LoRATarget

BASE_ONLY = -1  # a token's slot when its request runs without an adapter (and padding tokens')


class TokenSlots(nn.Module):
    """The adapter slot of each token of the step (`index[:num_tokens]`; BASE_ONLY past the step's tokens): one
    static buffer shared by every LoRALinear, written before each step."""

    def __init__(self, max_num_tokens: int, device: torch.device) -> None:
        super().__init__()
        self.register_buffer("index", torch.full((max_num_tokens,), BASE_ONLY, device=device), persistent=False)
        self.num_set = 0  # tokens the last step set (the rest already hold BASE_ONLY)

    def set(self, slots: torch.Tensor) -> None:
        """`slots` [num_tokens] (ints) for this step's tokens; every later token runs the base alone."""
        n = slots.shape[0]
        if n > self.index.shape[0]:
            raise ValueError(f"a step of {n} tokens: the LoRA buffers hold {self.index.shape[0]} (max_num_tokens)")
        if self.num_set > n:
            self.index[n : self.num_set].fill_(BASE_ONLY)
        self.index[:n].copy_(slots)
        self.num_set = n


class LoRALinear(nn.Module):
    """`base(x)` plus each token's adapter's product; `base` (plain, kernel-bound or packed) is left as it is."""

    def __init__(
        self, base: nn.Module, parts: list[LoRATarget], limits: LoRALimits, tokens: TokenSlots, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.base = base
        self.tokens = tokens
        self.in_features, self.out_features = base.in_features, base.out_features
        self.max_loras, self.max_rank = limits.max_loras, limits.max_rank
        self.parts = tuple((t.offset, t.rows) for t in parts)  # each part's output rows, which tile the output
        ends = list(accumulate(t.rows for t in parts))
        if [t.offset for t in parts] != [0, *ends[:-1]] or ends[-1] != self.out_features:
            raise ValueError(f"LoRA parts {self.parts} do not tile the layer's {self.out_features} outputs")
        self.block = self.max_loras * self.max_rank  # columns of one part
        width = len(parts) * self.block
        device = tokens.index.device
        self.register_buffer("lora_a", torch.zeros(width, self.in_features, dtype=dtype, device=device), False)
        self.register_buffer("lora_b", torch.zeros(self.out_features, self.block, dtype=dtype, device=device), False)
        column_slot = torch.arange(width, device=device) // self.max_rank % self.max_loras
        self.register_buffer("column_slot", column_slot, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        shrunk = F.linear(x, self.lora_a)
        shrunk = shrunk * (self.tokens.index[:n, None] == self.column_slot).to(shrunk.dtype)
        if len(self.parts) == 1:
            return self.base(x) + F.linear(shrunk, self.lora_b)
        expanded = [
            F.linear(shrunk[:, i * self.block : (i + 1) * self.block], self.lora_b[offset : offset + rows])
            for i, (offset, rows) in enumerate(self.parts)
        ]
        return self.base(x) + torch.cat(expanded, dim=-1)

    def rows(self, slot: int, part: int) -> slice:
        """Slot `slot`'s rows of A for part `part` (its columns of B are `rows(slot, 0)`)."""
        start = part * self.block + slot * self.max_rank
        return slice(start, start + self.max_rank)

    @torch.no_grad()
    def load_part(self, slot: int, part: int, layer: LoRALayer) -> None:
        """Slot `slot`'s adapter for part `part` (its scale folded into B); ranks below max_rank stay zero-padded."""
        offset, rows = self.parts[part]
        a, b = self.lora_a[self.rows(slot, part)], self.lora_b[offset : offset + rows, self.rows(slot, 0)]
        a.zero_()
        b.zero_()
        a[: layer.rank].copy_(layer.a)
        b[:, : layer.rank].copy_(layer.b * layer.scale)

    @torch.no_grad()
    def clear(self, slot: int) -> None:
        for part in range(len(self.parts)):
            self.lora_a[self.rows(slot, part)].zero_()
        self.lora_b[:, self.rows(slot, 0)].zero_()
