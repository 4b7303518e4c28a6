"""How many KV blocks an engine allocates, and the start-up lines that say so.

Each rank sizes its cache for the KV heads and layers it holds (a tensor-parallel rank holds some heads, a pipeline
stage some layers) within the same memory budget, and every rank then takes the smallest count: one block table
addresses all of their caches. A model whose sliding-window layers alternate with global ones splits its budget
in two pools (kiln.engine.kv_window).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kiln.config import CacheConfig, ModelConfig, SchedulerConfig
from kiln.distributed.control import agree_min
from kiln.engine.kv_window import max_decode_blocks, window_pool_blocks
from kiln.model.parallel import held_layers, local_kv_heads

logger = logging.getLogger("kiln")


def kv_cache_blocks(cc: CacheConfig, sc: SchedulerConfig, model: nn.Module, kv_dtype: torch.dtype) -> tuple[int, int]:
    """(blocks of the cache, blocks of the sliding layers' cache when they alternate with global layers, else 0):
    `cc.num_blocks`, else as many as `cc.kv_cache_memory_gb` holds on this rank; each count agreed by every rank.

    A hybrid model's sliding layers get `window_pool_blocks` (at most the global layers' count) and the global
    layers share the rest of the budget."""
    mc: ModelConfig = model.config
    held = held_layers(model) or range(mc.num_layers)
    per_layer_token = mc.kv_bytes_per_token(kv_dtype) * local_kv_heads(model) // (mc.num_kv_heads * mc.num_layers)
    layer_blocks = int(cc.kv_cache_memory_gb * 1e9) // (cc.block_size * per_layer_token)  # blocks x layers
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
) -> None:
    num_blocks, window_blocks = blocks
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens (%.2f GB %s), max_model_len=%d",
        num_blocks,
        cc.block_size,
        num_blocks * cc.block_size,
        nbytes / 1e9,
        str(kv_dtype).removeprefix("torch."),
        max_model_len,
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
