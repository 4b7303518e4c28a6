"""The recipe's overlay on the engine config: the one place where recipe values override flags, each logged.

Graph settings, the graph mode among them, are overlaid earlier, in `graph_config_from(recipe, **flags)`, where
explicit flags still win (and are logged as overrides); this module overlays the rest of the contract.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from kiln.config import EngineConfig
from kiln.recipe import Recipe

logger = logging.getLogger("kiln")


def overlay_recipe(config: EngineConfig, recipe: Recipe) -> EngineConfig:
    """`config` as the recipe requires: its device, quantization, dtype, KV cache plan, bounds and parallel layout
    (tensor and pipeline sizes, each stage's layers) win over flags. `config.graph` (the graph mode included)
    must already come from `graph_config_from(recipe, ...)`."""
    cache = replace(
        config.cache, dtype=recipe.kv_cache_dtype, block_size=recipe.block_size, num_blocks=recipe.max_pages
    )
    sched = config.scheduler
    if recipe.max_num_seqs is not None:
        sched = replace(sched, max_num_seqs=min(sched.max_num_seqs, recipe.max_num_seqs))
    if recipe.max_num_batched_tokens is not None:
        sched = replace(sched, max_num_batched_tokens=min(sched.max_num_batched_tokens, recipe.max_num_batched_tokens))
    max_model_len = config.max_model_len
    if recipe.max_model_len is not None:
        max_model_len = min(max_model_len or recipe.max_model_len, recipe.max_model_len)
    # NOTE: a recipe that places the model (parallel, device_affinity) wins, as validated against the model; one
    # that says nothing of placement leaves the --tensor/--pipeline-parallel-size flags as they are.
    parallel = config.parallel
    if "parallel" in recipe.spec.model_fields_set or recipe.spec.device_affinity is not None:
        parallel = replace(
            parallel,
            tensor=recipe.tensor_parallel,
            pipeline=recipe.pipeline_parallel,
            stage_layers=recipe.stage_layers,
        )
    resolved = replace(
        config,
        model=recipe.model_path,  # the checkpoint the recipe was checked against is the one that runs
        device=recipe.device,
        quantization=recipe.quantization,
        quantization_group_size=recipe.quantization_group_size,
        dtype=recipe.dtype,
        max_model_len=max_model_len,
        cache=cache,
        scheduler=sched,
        recipe=recipe,
        parallel=parallel,
    )
    _log_changes(config, resolved, recipe.path)
    return resolved


def _log_changes(before: EngineConfig, after: EngineConfig, path: str) -> None:
    pairs = [
        ("device", before.device, after.device),
        ("quantization", before.quantization, after.quantization),
        ("quantization group size", before.quantization_group_size, after.quantization_group_size),
        ("dtype", before.dtype, after.dtype),
        ("max_model_len", before.max_model_len, after.max_model_len),
        ("kv_cache.dtype", before.cache.dtype, after.cache.dtype),
        ("kv_cache.block_size", before.cache.block_size, after.cache.block_size),
        ("kv_cache.num_blocks", before.cache.num_blocks, after.cache.num_blocks),
        ("max_num_seqs", before.scheduler.max_num_seqs, after.scheduler.max_num_seqs),
        ("max_num_batched_tokens", before.scheduler.max_num_batched_tokens, after.scheduler.max_num_batched_tokens),
        ("parallel.tensor", before.parallel.tensor, after.parallel.tensor),
        ("parallel.pipeline", before.parallel.pipeline, after.parallel.pipeline),
        ("parallel.stage_layers", before.parallel.stage_layers, after.parallel.stage_layers),
    ]
    for name, old, new in pairs:
        if old != new:
            logger.info("Recipe %s sets %s=%s (was %s)", path, name, new, old)
