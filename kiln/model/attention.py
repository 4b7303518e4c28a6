"""`kiln::attention`: the paged-KV attention custom op and the graph's splitting point.

It writes the new K/V into the layer's paged cache at `slot_mapping`, then attends each query over its
sequence's blocks. Decodes (one query each) run as one batched SDPA over gathered blocks; prefill and
prefill chunks run per sequence with a causal mask offset by the cached context. Padding rows
(past `num_actual_tokens`) produce zeros and never touch the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.model.forward_context import AttentionMetadata, get_forward_context

SPLITTING_OP = "kiln.attention"


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    n = slot_mapping.numel()
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k[:n].view(n, num_kv_heads, head_dim))
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v[:n].view(n, num_kv_heads, head_dim))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[..., seq_len, kv_heads, head_dim] of one or many sequences from the block pool."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache[block_table[..., :num_blocks]]  # [..., nb, bs, H, D]
    return blocks.flatten(-4, -3)[..., :seq_len, :, :]


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    head_dim = kv_cache.shape[-1]
    num_heads = q.shape[1] // head_dim
    n = meta.num_actual_tokens
    write_kv(kv_cache, k, v, meta.slot_mapping)
    out = q.new_zeros(q.shape)
    qh = q[:n].view(n, num_heads, head_dim)
    nd = meta.num_decodes
    if nd:
        table, mask, max_len = meta.decode_layout
        kv = kv_cache[:, table].flatten(2, 3)[:, :, :max_len].transpose(2, 3)  # [2, nd, Hkv, L, D]
        o = F.scaled_dot_product_attention(qh[:nd].unsqueeze(2), kv[0], kv[1], attn_mask=mask, enable_gqa=True)
        out[:nd] = o.reshape(nd, num_heads * head_dim)
    for i in range(nd, meta.num_seqs):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        q_len, seq_len = end - start, meta.seq_lens[i]
        qi = qh[start:end].transpose(0, 1)  # [H, q_len, D]
        if q_len == seq_len:  # whole prompt in this step: attend over the new K/V directly
            ki = k[start:end].view(q_len, -1, head_dim).transpose(0, 1)
            vi = v[start:end].view(q_len, -1, head_dim).transpose(0, 1)
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)
        else:  # a chunk after cached context: causal mask offset by the context length
            ki = gather_kv(kv_cache[0], meta.block_tables[i], seq_len).transpose(0, 1)
            vi = gather_kv(kv_cache[1], meta.block_tables[i], seq_len).transpose(0, 1)
            context = seq_len - q_len
            rows = torch.arange(q_len, device=q.device)[:, None] + context
            mask = torch.arange(seq_len, device=q.device)[None, :] <= rows
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, enable_gqa=True)
        out[start:end] = o.transpose(0, 1).reshape(q_len, num_heads * head_dim)
    return out


@torch.library.custom_op("kiln::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int) -> torch.Tensor:
    """q: [num_tokens, heads*head_dim]; k, v: [num_tokens, kv_heads*head_dim] -> [num_tokens, heads*head_dim].

    Metadata and the layer's cache come from the forward context, so the op's graph signature depends
    only on `num_tokens` (symbolic in graph mode).
    """
    ctx = get_forward_context()
    return paged_attention(q, k, v, ctx.kv_caches[layer_idx], ctx.attn_metadata)


@attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int) -> torch.Tensor:
    return torch.empty_like(q)
