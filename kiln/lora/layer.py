"""`LoRALinear`: a linear layer plus the batched LoRA products of every adapter slot, and `TokenSlots`, the step's
slot per token that they all read.

S-LoRA/Punica style, in one shape for every step: all slots' A matrices are stacked in one static buffer (and their
B matrices in another), so a step multiplies by every slot at once and keeps, per token, the columns of its own slot:

    shrunk = x @ A_all^T                    [tokens, parts * slots * rank]
    shrunk *= (slot[token] == column_slot)  zero but the token's own slot (-1: none, the base alone)
    out = base(x) + shrunk @ Bt_all         Bt_all [slots * rank, out] holds each slot's (B * scale)^T

A fused module (qkv_proj, gate_up_proj) has one block of A rows per part, and each part's output rows take the
product of their own block only (one expand per part, concatenated): B is never stored block-diagonal.
That is the `stacked` form (kiln.lora.forms); few rows run the `gathered` form instead (Punica's bgmv: each token
reads its own slot's A and B only), or kiln's native kernel of the same arithmetic where the kernel plan timed it
faster (kiln.kernels.lora sets `few_rows`), over the same buffers. The forms read buffers that the compiled pieces
take as inputs by reference (kiln.compile never freezes them), so loading an adapter is a copy into the buffers:
nothing recompiles or recaptures. Which form a step runs (`form_for`) follows its rows: an eager step runs
`few_rows` up to GATHERED_MAX_ROWS rows, a full decode graph (decode steps only) runs `few_rows`, and more rows (the
graph pieces, which serve prefill chunks) stack, unless `few_rows` is a form whose work follows the rows at any count
(the native kernel's: `LoRAForm.any_rows`).
"""

from __future__ import annotations

from itertools import accumulate

import torch
from torch import nn

from kiln.lora.checkpoint import LoRALayer
from kiln.lora.config import LoRALimits
from kiln.lora.forms import FORMS, GATHERED, STACKED, LoRAForm
from kiln.lora.targets import LoRATarget
from kiln.model.forward_context import get_forward_context

BASE_ONLY = -1  # a token's slot when its request runs without an adapter (and padding tokens')
# NOTE: the gathered form's work grows with rows x one slot's weights, the stacked one's with max_loras slots' once;
# a decode step of 64 rows reads at most 64 slot blocks of a few hundred kB (they stay in cache across the step's
# rows of one adapter), and an eager gathered step materializes them, which a 2,048-token prefill chunk must not
GATHERED_MAX_ROWS = 64


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
        # B transposed: a slot's rank rows over every output column (a token's expand adds `rank` scaled rows)
        self.register_buffer("lora_b", torch.zeros(self.block, self.out_features, dtype=dtype, device=device), False)
        column_slot = torch.arange(width, device=device) // self.max_rank % self.max_loras
        self.register_buffer("column_slot", column_slot, persistent=False)
        # the form few rows run: gathered, or what the kernel plan timed faster here (kiln.kernels.lora)
        self.few_rows: LoRAForm = FORMS[GATHERED]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.form_for(x.shape[0]).forward(self, x)

    def form_for(self, rows: int | torch.SymInt) -> LoRAForm:
        """The form a step of `rows` rows runs (module docstring): decided while tracing, never guarded on."""
        many = FORMS[STACKED] if not self.few_rows.any_rows else self.few_rows
        if torch.compiler.is_compiling():
            # NOTE: dynamo shows a symbolic row count as an int, and comparing it would be a guard kiln never checks:
            # a traced graph takes the form of the steps it serves. A full decode graph runs decode steps only (one
            # row per sequence, up to its largest capture size); pieces serve prefill chunks too.
            return self.few_rows if get_forward_context().decode is not None else many
        return self.few_rows if rows <= GATHERED_MAX_ROWS else many

    def rows(self, slot: int, part: int) -> slice:
        """Slot `slot`'s rows of A for part `part` (its rows of the transposed B are `rows(slot, 0)`)."""
        start = part * self.block + slot * self.max_rank
        return slice(start, start + self.max_rank)

    @torch.no_grad()
    def load_part(self, slot: int, part: int, layer: LoRALayer) -> None:
        """Slot `slot`'s adapter for part `part` (its scale folded into B); ranks below max_rank stay zero-padded."""
        offset, rows = self.parts[part]
        a, b = self.lora_a[self.rows(slot, part)], self.lora_b[self.rows(slot, 0), offset : offset + rows]
        a.zero_()
        b.zero_()
        a[: layer.rank].copy_(layer.a)
        b[: layer.rank].copy_((layer.b * layer.scale).t())

    @torch.no_grad()
    def clear(self, slot: int) -> None:
        for part in range(len(self.parts)):
            self.lora_a[self.rows(slot, part)].zero_()
        self.lora_b[self.rows(slot, 0)].zero_()
