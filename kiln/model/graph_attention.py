"""Decode attention the compiler can see: the attention of a full decode graph (kiln.compile.full_graph).

Every decode sequence has one query token. The step's layout is two tensors the executor keeps in persistent
buffers and updates in place (kiln.compile.decode_buffers), so a traced graph reads them as inputs:
- `seq_lens` [num_tokens] int64: tokens of each sequence including the new one (padding rows: 1);
- `block_table` [num_tokens, num_blocks] int64: each sequence's KV blocks (padding: the null block);
- `window_table`, same shape, when sliding layers alternate with global ones: the sliding layers' own blocks.

Positions and KV slots are derived from them here, on the device, never rebuilt on the host. The product is
written as element-wise products and sums over the block-table gather (not `matmul`), so inductor fuses the
gather into its reductions and never materialises the gathered K/V; `fullgraph=True` tracing holds (no opaque
op, no graph break). Padding rows attend to the null block's first slot, so their outputs are finite and the
cache blocks of real sequences are never touched. A sliding-window layer (`window` > 0, the semantics of
kiln.model.attention) also hides the keys more than `window - 1` positions before each query; the window is a
Python int, so each layer's graph is traced with its own constant. So is `softcap` (> 0: the scores are
soft-capped, tanh(s / softcap) * softcap, before the mask, as in the op).

`attend` is what the model calls: this path while a decode graph is traced (the forward context carries
`DecodeInputs`), else the opaque paged-attention op (kiln.model.attention), the piecewise splitting point.
"""

from __future__ import annotations

import torch

from kiln.model.forward_context import DecodeInputs, DecodeKernel, get_forward_context
from kiln.model.kv_format import cache_head_dim, store, unpack_rows


def decode_positions(seq_lens: torch.Tensor) -> torch.Tensor:
    """Position of each decode token: the last of its sequence."""
    return seq_lens.clamp(min=1) - 1


def decode_slots(seq_lens: torch.Tensor, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat KV-cache slot of each decode token, from its position and its sequence's block table."""
    pos = decode_positions(seq_lens)
    block = block_table.gather(1, (pos // block_size)[:, None]).squeeze(1)
    return block * block_size + pos % block_size


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    decode: DecodeInputs,
    window: int = 0,
    softcap: float = 0.0,
    kernel: DecodeKernel | None = None,
) -> torch.Tensor:
    """q: [n, heads*head_dim]; k, v: [n, kv_heads*head_dim] -> [n, heads*head_dim]. Writes k, v to the cache, then
    attends with `kernel` (the plan's, kiln.kernels.attention), or the traced torch form when None."""
    _, num_kv_heads, _, block_size, _ = kv_cache.shape
    head_dim = cache_head_dim(kv_cache)
    n = q.shape[0]
    seq_lens = decode.seq_lens
    # a hybrid model's sliding layers read their own blocks (kiln.engine.scheduling.kv_window)
    table = decode.window_table if window and decode.window_table is not None else decode.block_table
    torch._check(seq_lens.shape[0] == n)
    torch._check(table.shape[0] == n)
    new = torch.stack((k, v)).view(2, n, num_kv_heads, head_dim).transpose(1, 2)
    store(kv_cache, new, decode_slots(seq_lens, table, block_size))  # packed to the cache's dtype
    if kernel is not None:  # one opaque node of the graph
        return kernel.run(q, kv_cache, table, seq_lens, window, softcap)
    return traced_decode_attention(q, kv_cache, table, seq_lens, window, softcap)


def traced_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    table: torch.Tensor,
    seq_lens: torch.Tensor,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """The torch form of decode attention (the cache already holds the new K/V): q [n, heads*head_dim], row i over
    the first seq_lens[i] keys of `table[i]`'s blocks -> [n, heads*head_dim]."""
    _, num_kv_heads, _, block_size, _ = kv_cache.shape
    head_dim = cache_head_dim(kv_cache)
    n = q.shape[0]
    num_heads = q.shape[1] // head_dim
    group = num_heads // num_kv_heads
    width = table.shape[1] * block_size
    kv = unpack_rows(kv_cache[:, :, table], q.dtype).view(2, num_kv_heads, n, width, head_dim)  # [2, Hkv, n, L, D]
    qg = q.view(n, num_kv_heads, group, head_dim).transpose(0, 1)  # [Hkv, n, G, D]
    scores = (qg[:, :, :, None, :] * kv[0][:, :, None]).sum(-1).float() * head_dim**-0.5  # [Hkv, n, G, L]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    logical, lens = torch.arange(width, device=q.device)[None, :], seq_lens.clamp(min=1)[:, None]
    hidden = logical >= lens  # [n, L]
    if window:
        hidden = hidden | (logical < lens - window)  # before decode_positions - window + 1
    probs = scores.masked_fill(hidden[None, :, None, :], float("-inf")).softmax(-1).to(q.dtype)
    out = (probs[..., None] * kv[1][:, :, None]).sum(-2)  # [Hkv, n, G, D]
    return out.transpose(0, 1).reshape(n, num_heads * head_dim)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int, window: int = 0, softcap: float = 0.0
) -> torch.Tensor:
    """The model's attention call: traced decode attention inside a decode graph, else the paged-attention op.
    `window` > 0: the layer's sliding window (0: global attention); `softcap` > 0: its attention-logit soft-cap."""
    ctx = get_forward_context()
    if ctx.decode is not None:
        return decode_attention(q, k, v, ctx.kv_caches[layer_idx], ctx.decode, window, softcap, ctx.decode_kernel)
    return torch.ops.kiln.attention(q, k, v, layer_idx, window, softcap)
