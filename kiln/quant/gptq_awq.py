"""GPTQ and AWQ checkpoints (transformers' `quant_method: gptq | awq`) -> kiln's packed form.

Their layouts, as AutoGPTQ / GPTQModel and AutoAWQ write them (`b` bits, `p = 32 / b` values per int32):

| tensor  | GPTQ                                                  | AWQ (GEMM)                                        |
|---------|-------------------------------------------------------|---------------------------------------------------|
| qweight | int32 [in / p, out]: input j in word j // p, bits     | int32 [in, out / p]: output columns packed in the |
|         | b * (j % p) up                                        | order 0 2 4 6 1 3 5 7 of each word's eight        |
| qzeros  | int32 [groups, out / p], packed along the output;     | int32 [groups, out / p], packed as qweight        |
|         | `checkpoint_format: gptq` stores zero - 1             |                                                   |
| scales  | float16 [groups, out]                                 | float16 [groups, out]                             |
| g_idx   | int32 [in]: each input column's group (act order)     | (none)                                            |

and `w[o, j] = (q[j, o] - zero[g(j), o]) * scale[g(j), o]` with unsigned q and zero.
"""

from __future__ import annotations

import torch

from kiln.quant.codes import integer_form, ordered_form
from kiln.quant.linear import PackedTensor

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's order of eight 4-bit output columns in one int32


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [n / p, m] -> [n, m] unsigned values: value i of each word from bits b * i up (GPTQ's qweight)."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32).view(1, per_word, 1)
    values = (packed.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return values.reshape(-1, packed.shape[-1])


def unpack_columns(packed: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [n, m / p] -> [n, m] unsigned values packed along columns; `order[i]`: the column within each word's
    p columns that bits b * i up hold (AWQ), default i (GPTQ's qzeros)."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32).view(1, 1, per_word)
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [n, words, slot]
    if order is not None:
        values = values[..., torch.tensor(order).argsort()]  # slot -> column within the word
    return values.reshape(packed.shape[0], -1)


def gptq_form(tensors: dict[str, torch.Tensor], bits: int, zero_minus_one: bool) -> PackedTensor | torch.Tensor:
    """A GPTQ layer as kiln runs it: packed codes; act-ordered groups (desc_act's `g_idx`) sorted into contiguous
    columns, the sort folded into the layer as its input order (kiln.quant.codes.ordered_form)."""
    q = unpack_rows(tensors["qweight"], bits).T.contiguous()  # [out, in]
    scales = tensors["scales"].float().T.contiguous()  # [out, groups]
    zeros = unpack_columns(tensors["qzeros"], bits)[:, : scales.shape[0]].T  # [out, groups]
    zeros = zeros + 1 if zero_minus_one else zeros
    g_idx = tensors.get("g_idx")
    if g_idx is None:
        return integer_form(q, scales, zeros, bits, signed=False)
    return ordered_form(q, scales, zeros, bits, signed=False, g_idx=g_idx)


def awq_form(tensors: dict[str, torch.Tensor], bits: int) -> PackedTensor:
    """An AWQ (GEMM) layer's packed codes: zero points always, groups of contiguous input columns."""
    q = unpack_columns(tensors["qweight"], bits, AWQ_ORDER).T.contiguous()  # [out, in]
    zeros = unpack_columns(tensors["qzeros"], bits, AWQ_ORDER).T.contiguous()  # [out, groups]
    scales = tensors["scales"].float().T.contiguous()
    return integer_form(q, scales, zeros, bits, signed=False)
