"""How many KV blocks an engine allocates, and the start-up lines that say so.

Each rank sizes its cache for the KV heads and layers it holds (a tensor-parallel rank holds some heads, a pipeline
stage some layers) within the same memory budget, and every rank then takes the smallest count: one block table
addresses all of their caches.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kiln.config import CacheConfig, ModelConfig
from kiln.distributed.control import agree_min
from kiln.engine.kv_window import max_decode_blocks
from kiln.model.parallel import held_layers, local_kv_heads

logger = logging.getLogger("kiln")


def kv_cache_blocks(cc: CacheConfig, model: nn.Module, kv_dtype: torch.dtype) -> int:
    """`cc.num_blocks`, else as many blocks as `cc.kv_cache_memory_gb` holds on this rank; agreed by every rank."""
    mc: ModelConfig = model.config
    layers = len(held_layers(model) or range(mc.num_layers))
    per_token = mc.kv_bytes_per_token(kv_dtype) * local_kv_heads(model) * layers // (mc.num_kv_heads * mc.num_layers)
    return agree_min(cc.num_blocks or max(1, int(cc.kv_cache_memory_gb * 1e9) // (cc.block_size * per_token)))


def log_kv_cache(
    cc: CacheConfig, num_blocks: int, nbytes: int, kv_dtype: torch.dtype, max_model_len: int, mc: ModelConfig
) -> None:
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
