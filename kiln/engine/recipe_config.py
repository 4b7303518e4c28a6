"""Apply a validated recipe to the engine config: the one place where recipe values override flags, logged."""

from __future__ import annotations

import logging
from dataclasses import fields, replace
from typing import Any

from kiln.config import EngineConfig, GraphConfig
from kiln.recipe import Recipe, load_recipe

logger = logging.getLogger("kiln")


def resolve_recipe(config: EngineConfig) -> tuple[EngineConfig, Recipe | None]:
    """Load `config.recipe` (if any) and return the config the engine must run with.

    The recipe is the contract: its dtype, KV cache plan, bounds and graph settings win over flags. Each value
    that changes is logged, so nothing is rewritten silently; explicit graph flags (capture sizes, compiler,
    piece modes, dump/cache dirs) still apply on top, as `graph_config_from` logs.
    """
    if not config.recipe:
        return config, None
    from kiln.compile.settings import graph_config_from

    recipe = load_recipe(config.recipe, model=config.model)
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
    graph_flags = _changed_fields(config.graph, GraphConfig())
    graph = graph_config_from(recipe, **graph_flags)
    resolved = replace(
        config,
        dtype=recipe.dtype,
        max_model_len=max_model_len,
        cache=cache,
        scheduler=sched,
        graph=graph,
        enable_piecewise_graph=config.enable_piecewise_graph or recipe.piecewise,
    )
    _log_changes(config, resolved, recipe.path)
    return resolved, recipe


def _changed_fields(obj: Any, default: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in fields(obj) if getattr(obj, f.name) != getattr(default, f.name)}


def _log_changes(before: EngineConfig, after: EngineConfig, path: str) -> None:
    pairs = [
        ("dtype", before.dtype, after.dtype),
        ("max_model_len", before.max_model_len, after.max_model_len),
        ("kv_cache.dtype", before.cache.dtype, after.cache.dtype),
        ("kv_cache.block_size", before.cache.block_size, after.cache.block_size),
        ("kv_cache.num_blocks", before.cache.num_blocks, after.cache.num_blocks),
        ("max_num_seqs", before.scheduler.max_num_seqs, after.scheduler.max_num_seqs),
        ("max_num_batched_tokens", before.scheduler.max_num_batched_tokens, after.scheduler.max_num_batched_tokens),
        ("piecewise graph", before.enable_piecewise_graph, after.enable_piecewise_graph),
    ]
    for name, old, new in pairs:
        if old != new:
            logger.info("Recipe %s sets %s=%s (was %s)", path, name, new, old)
