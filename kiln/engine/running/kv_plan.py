"""How many KV blocks an engine allocates, and the start-up lines that say so.

Each rank sizes its cache for the KV heads and layers it holds (a tensor-parallel rank holds some heads, a pipeline
stage some layers) within the same memory budget, and every rank then takes the smallest count: one block table
addresses all of their caches. A model whose sliding-window layers alternate with global ones splits its budget
in two pools (kiln.engine.scheduling.kv_window).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kiln.config import DEFAULT_KV_CACHE_GB, CacheConfig, ModelConfig, SchedulerConfig
from kiln.distributed.control import agree_min
from kiln.engine.scheduling.kv_window import max_decode_blocks, window_pool_blocks
from kiln.model.kv_format import kv_dtype_name
from kiln.model.parallel import held_layers, local_kv_heads
from kiln.platforms import platform_of

logger = logging.getLogger("kiln")


def kv_budget(cc: CacheConfig, device: torch.device, ranks_on_node: int = 1) -> tuple[int, str]:
    """(bytes this rank's KV cache may take, the start-up line's reason): `cc.num_blocks` (the bytes unused then),
    else `cc.kv_cache_memory_gb`, else `cc.kv_cache_memory_fraction` of the memory available now (the weights are
    loaded), else DEFAULT_KV_CACHE_GB. On CPU the `ranks_on_node` ranks of a machine share its RAM: each gets its
    part of what is available."""
    available = platform_of(device).available_memory_gb(device)
    where = f"{available:.1f} GB available after the weights"
    if not platform_of(device).separate_memory and ranks_on_node > 1:
        available /= ranks_on_node
        where += f", {available:.1f} GB for each of {ranks_on_node} ranks"
    if cc.num_blocks:
        return 0, f"--num-kv-blocks or the recipe's pages; {where}"
    if cc.kv_cache_memory_gb is None and cc.kv_cache_memory_fraction is not None:
        f = cc.kv_cache_memory_fraction
        return int(f * available * 1e9), f"--kv-cache-memory-fraction {f:g} of the {where}"
    gb = cc.kv_cache_memory_gb if cc.kv_cache_memory_gb is not None else DEFAULT_KV_CACHE_GB
    flag = "--kv-cache-memory-gb" if cc.kv_cache_memory_gb is not None else "the default"
    if gb > available:
        logger.warning("KV cache: %s %g GB is more than the %s: the machine may swap", flag, gb, where)
    return int(gb * 1e9), f"{flag} {gb:g} GB; {where}"


def kv_cache_blocks(
    cc: CacheConfig, sc: SchedulerConfig, model: nn.Module, kv_dtype: torch.dtype, budget: int
) -> tuple[int, int]:
    """(blocks of the cache, blocks of the sliding layers' cache when they alternate with global layers, else 0):
    `cc.num_blocks`, else as many as `budget` bytes (`kv_budget`'s) hold on this rank; each count agreed by every
    rank.

    A hybrid model's sliding layers get `window_pool_blocks` (at most the global layers' count) and the global
    layers share the rest of the budget."""
    mc: ModelConfig = model.config
    held = held_layers(model) or range(mc.num_layers)
    per_layer_token = mc.kv_bytes_per_token(kv_dtype) * local_kv_heads(model) // (mc.num_kv_heads * mc.num_layers)
    layer_blocks = budget // (cc.block_size * per_layer_token)  # blocks x layers
    window = mc.hybrid_sliding_window
    if not window:
        return agree_min(cc.num_blocks or max(1, layer_blocks // len(held))), 0
    needed = window_pool_blocks(window, cc.block_size, sc.max_num_seqs, sc.max_num_batched_tokens)
    if cc.num_blocks:
        return agree_min(cc.num_blocks), agree_min(min(cc.num_blocks, needed))
    sliding = sum(1 for i in held if mc.layer_window(i))
    window_blocks = max(1, min(needed, layer_blocks // len(held)))
    num_blocks = max(1, (layer_blocks - sliding * window_blocks) // max(1, len(held) - sliding))
    return agree_min(num_blocks), agree_min(window_blocks)


def log_kv_cache(
    cc: CacheConfig,
    blocks: tuple[int, int],
    nbytes: int,
    kv_dtype: torch.dtype,
    max_model_len: int,
    mc: ModelConfig,
    reason: str = "",
    huge_bytes: int = 0,
) -> None:
    """The start-up lines of the cache: its size, its dtype (and that `auto` chose it), how much of it lies on huge
    pages (`huge_bytes`, kiln.huge_pages), and `reason` (`kv_budget`'s); and how a sliding window uses it."""
    num_blocks, window_blocks = blocks
    pages = f", {min(1.0, huge_bytes / nbytes):.0%} on 2 MB pages" if huge_bytes and nbytes else ""
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens (%.2f GB %s)%s, max_model_len=%d%s",
        num_blocks,
        cc.block_size,
        num_blocks * cc.block_size,
        nbytes / 1e9,
        kv_dtype_name(kv_dtype) + (" (--kv-cache-dtype auto)" if cc.dtype == "auto" else ""),
        pages,
        max_model_len,
        f" ({reason})" if reason else "",
    )
    if window := mc.uniform_sliding_window:
        logger.info(
            "KV cache: sliding window %d on every layer: blocks behind the window are released (at most %d "
            "blocks per decoding sequence)",
            window,
            max_decode_blocks(window, cc.block_size),
        )
    elif window := mc.hybrid_sliding_window:
        sliding = sum(1 for i in range(mc.num_layers) if mc.layer_window(i))
        logger.info(
            "KV cache: %d sliding-window layers (window %d) keep %d blocks of their own, released behind the "
            "window (at most %d per decoding sequence); the %d global layers hold the %d above",
            sliding,
            window,
            window_blocks,
            max_decode_blocks(window, cc.block_size),
            mc.num_layers - sliding,
            num_blocks,
        )
