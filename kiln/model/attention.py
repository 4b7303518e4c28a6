"""`kiln::attention`: the paged-KV attention custom op and the graph's splitting point.

It writes the new K/V into the layer's paged cache at `slot_mapping`, then attends each query over its
sequence's blocks. Decodes (one query each) run batched over gathered blocks; prompts and chunks of prompts run
together, in one native call or a few masked SDPA calls a step (kiln.model.prefill_attention), causal from each
one's cached context.
Padding rows (past `num_actual_tokens`)
produce zeros and never touch the cache.

Sliding-window attention (Mistral, Gemma 2, Qwen2): with `window` W > 0 a query at position i sees key j iff
j <= i and i - j < W; W = 0 is global attention and costs nothing extra. The window is per layer (an op
argument), so one model may mix sliding and global layers.

Attention-logit soft-capping (Gemma 2): with `softcap` C > 0 the scaled scores s become tanh(s / C) * C before the
mask and the softmax. SDPA cannot do that, so prefill then takes an explicit matmul-softmax path; C = 0 (the
default) leaves every path as it is.

The cache may hold a narrower dtype than the model computes in (`--kv-cache-dtype`, a recipe's `kv_cache.dtype`;
kiln.model.kv_format: bfloat16, float16, or int8 and fp8_e4m3 codes with a scale per token and head): new K/V are
packed to it when written and unpacked when read. Every path attends over the stored values, a whole prompt's
prefill too (its new K/V read back as stored), so a prompt's outputs do not depend on whether its prefix came from
the prefix cache, an earlier chunk or this step.

Decode rows run on the kernel the engine's plan chose (`ForwardContext.decode_kernel`, kiln.kernels.attention):
kiln's native paged kernel, which reads the blocks where they lie, or the batched torch form below; prompts on the
plan's prefill kernel (`ForwardContext.prefill_kernel`): the native one, or the grouped SDPA form.

Cache layout per layer: [2 (K, V), num_kv_heads, num_blocks, block_size, row] (row: head_dim, plus the scale's
bytes for int8 and fp8_e4m3). Heads come first so that gathered blocks are already [kv_heads, tokens, head_dim] per
sequence: the decode path multiplies them in place, grouping the query heads that share a KV head (GQA) as rows of
one small matmul, with no copy into an attention layout (measured: 2.5x faster than SDPA over strided gathered K/V
at batch 32).
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from kiln.config import ModelConfig
from kiln.model.forward_context import AttentionMetadata, DecodeKernel, PrefillKernel, get_forward_context
from kiln.model.kv_format import cache_head_dim, row_width, store, unpack_rows
from kiln.model.prefill_attention import prefill_attention
from kiln.platforms import platform_of

SPLITTING_OP = "kiln.attention"


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32
) -> tuple[int, ...]:
    """`num_blocks` usable blocks plus the null block (the last), which no sequence owns: padding rows of a
    captured decode graph write and read there (kiln.model.graph_attention). Rows of a cache of torch dtype
    `dtype` are kiln.model.kv_format's."""
    return (2, num_kv_heads, num_blocks + 1, block_size, row_width(head_dim, dtype))


def allocate_kv_caches(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    num_kv_heads: int | None = None,
    layers: Collection[int] | None = None,
    window_blocks: int = 0,
) -> list[torch.Tensor]:
    """One zeroed cache per layer, laid out by `kv_cache_shape` and placed by its device's platform (on CPU on
    transparent huge pages where Linux gives them: kiln.huge_pages), for `num_kv_heads` (default: all of the model's;
    a tensor-parallel rank holds its own). A layer outside `layers` (another pipeline stage's) gets a cache of no
    heads: the same geometry, no memory. `window_blocks` > 0: the sliding-window layers of a model that mixes them
    with global ones hold that many blocks (their own pool, kiln.engine.scheduling.kv_window), the others
    `num_blocks`."""
    heads = num_kv_heads or config.num_kv_heads

    def blocks(i: int) -> int:
        return window_blocks if window_blocks and config.layer_window(i) else num_blocks

    platform = platform_of(device)
    return [
        platform.kv_cache_zeros(
            kv_cache_shape(
                num_blocks=blocks(i),
                block_size=block_size,
                num_kv_heads=heads if layers is None or i in layers else 0,
                head_dim=config.head_dim,
                dtype=dtype,
            ),
            dtype=dtype,
            device=device,
        )
        for i in range(config.num_layers)
    ]


def null_block(kv_cache: torch.Tensor) -> int:
    """The block no sequence owns (`kv_cache_shape`): padding rows of a decode graph point at it."""
    return kv_cache.shape[2] - 1


def cache_nulls(config: ModelConfig, kv_caches: list[torch.Tensor]) -> tuple[int, int | None]:
    """(the null block of the global layers' caches, that of a hybrid model's sliding layers' caches or None when it
    has none): padding rows of a decode graph's two block tables point at them."""
    window = [i for i in range(config.num_layers) if config.layer_window(i)] if config.hybrid_sliding_window else []
    full = next(i for i in range(config.num_layers) if i not in window)
    return null_block(kv_caches[full]), null_block(kv_caches[window[0]]) if window else None


def kv_cache_block_size(kv_cache: torch.Tensor) -> int:
    """Tokens per block in one layer's cache (laid out by `kv_cache_shape`)."""
    return kv_cache.shape[3]


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Write the first `slot_mapping.numel()` rows of k, v at their slots; returns them as stored
    [2, kv_heads, n, row] (kiln.model.kv_format)."""
    num_kv_heads, head_dim = kv_cache.shape[1], cache_head_dim(kv_cache)
    n = slot_mapping.numel()
    new = torch.stack((k[:n], v[:n])).view(2, n, num_kv_heads, head_dim).transpose(1, 2)  # [2, Hkv, n, D]
    return store(kv_cache, new, slot_mapping)


def decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, softcap: float = 0.0
) -> torch.Tensor:
    """q: [num_decodes, heads, head_dim] -> [num_decodes, heads * head_dim]. `meta` is the layer's view
    (`AttentionMetadata.for_layer`): its decode layout masks the keys behind a sliding window."""
    num_kv_heads, head_dim = kv_cache.shape[1], cache_head_dim(kv_cache)
    nd, num_heads, _ = q.shape
    table, mask = meta.decode_layout
    kv = unpack_rows(kv_cache.index_select(2, table), q.dtype).view(2, num_kv_heads, nd, -1, head_dim)  # [2,Hkv,nd,L,D]
    qg = q.view(nd, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)  # [Hkv, nd, G, D]
    scores = torch.matmul(qg, kv[0].transpose(-1, -2)).float() * head_dim**-0.5  # [Hkv, nd, G, L]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    out = torch.matmul((scores + mask).softmax(-1).to(q.dtype), kv[1])  # [Hkv, nd, G, D]
    return out.transpose(0, 1).reshape(nd, num_heads * head_dim)


def decodes(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    window: int,
    softcap: float,
    kernel: DecodeKernel | None,
) -> torch.Tensor:
    """The step's decode rows (q [num_decodes, heads, head_dim], the layer's view `meta`) with `kernel`, the plan's
    (kiln.kernels.attention), or the batched torch form when None."""
    if kernel is None:
        return decode_attention(q, kv_cache, meta, softcap)
    nd = q.shape[0]
    return kernel.run(
        q=q.reshape(nd, -1),
        kv_cache=kv_cache,
        block_table=meta.block_tables[:nd],
        seq_lens=meta.seq_lens_tensor[:nd],
        window=window,
        softcap=softcap,
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    window: int = 0,
    softcap: float = 0.0,
    kernel: DecodeKernel | None = None,
    prefill_kernel: PrefillKernel | None = None,
) -> torch.Tensor:
    head_dim = cache_head_dim(kv_cache)
    num_heads = q.shape[1] // head_dim
    meta = meta.for_layer(window)
    n = meta.num_actual_tokens
    write_kv(kv_cache, k, v, meta.slot_mapping)
    qh = q[:n].view(n, num_heads, head_dim)
    nd = meta.num_decodes
    if nd == n == q.shape[0]:  # decode-only, unpadded: no output copy
        return decodes(q=qh, kv_cache=kv_cache, meta=meta, window=window, softcap=softcap, kernel=kernel)
    out = q.new_zeros(q.shape)
    if nd:
        out[:nd] = decodes(q=qh[:nd], kv_cache=kv_cache, meta=meta, window=window, softcap=softcap, kernel=kernel)
    # every prompt and chunk: a few calls, not one each
    prefill_attention(
        qh=qh, kv_cache=kv_cache, meta=meta, out=out, window=window, softcap=softcap, kernel=prefill_kernel
    )
    return out


@torch.library.custom_op("kiln::attention", mutates_args=())
def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int, window: int = 0, softcap: float = 0.0
) -> torch.Tensor:
    """q: [num_tokens, heads*head_dim]; k, v: [num_tokens, kv_heads*head_dim] -> [num_tokens, heads*head_dim].

    Metadata and the layer's cache come from the forward context, so the op's graph signature depends
    only on `num_tokens` (symbolic in graph mode). `window` > 0: the layer's sliding window; `softcap` > 0: its
    attention-logit soft-cap (module docstring).
    """
    ctx = get_forward_context()
    return paged_attention(
        q=q,
        k=k,
        v=v,
        kv_cache=ctx.kv_caches[layer_idx],
        meta=ctx.attn_metadata,
        window=window,
        softcap=softcap,
        kernel=ctx.decode_kernel,
        prefill_kernel=ctx.prefill_kernel,
    )


@attention.register_fake
def _(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int, window: int = 0, softcap: float = 0.0
) -> torch.Tensor:
    return torch.empty_like(q)
