"""The recipe's overlay on the engine config: the recipe's part of the one precedence (kiln.engine.setup.resolve,
which calls `overlay_recipe`; graph settings are overlaid by kiln.compile.settings under the same rule).

The recipe is the contract; a flag left at its default never changes it. A flag given (a value other than its
default) that disagrees with the recipe:
- on a setting of how the model is run (graph mode, compiler, capture and compile sizes, piece modes, speculative
  decoding): wins, and is
  logged once ("Graph setting compiler=eager overrides the recipe's inductor"): the recipe's checks still hold;
- on a bound (max_num_seqs, max_num_batched_tokens, max_model_len): may narrow it (logged), never raise it;
- on a fact the recipe was checked against (device, dtype, quantization, its group size and activations, the KV
  cache plan, the parallel layout, the LoRA buffers: --enable-lora, --max-loras, --max-lora-rank): is refused,
  naming the flag, the recipe and both values.
Every value the recipe changes is logged once ("Recipe r.yaml sets max_model_len=256 (was None)").
"""

from __future__ import annotations

import logging
from dataclasses import replace

from kiln.config import EngineConfig, LoRAConfig
from kiln.errors import ConfigError
from kiln.recipe import Recipe

logger = logging.getLogger("kiln")


def overlay_recipe(config: EngineConfig, recipe: Recipe) -> EngineConfig:
    """`config` as the recipe requires: its device, quantization, dtype, KV cache plan, bounds and parallel layout.
    `config.graph` (the graph mode included) must already come from `graph_config_from(recipe, ...)`. ConfigError
    for a given flag that contradicts the recipe (see the module's precedence)."""
    cache = replace(
        config.cache,
        dtype=recipe.kv_cache_dtype,
        block_size=recipe.block_size,
        num_blocks=recipe.max_pages,
        # either the recipe or --no-enable-prefix-caching turns caching off
        enable_prefix_caching=config.cache.enable_prefix_caching and recipe.prefix_caching,
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
    # NOTE: speculation is a setting of how the model runs: a --speculative-method flag wins over the recipe's (logged)
    speculative = config.speculative
    if recipe.speculative is not None and recipe.speculative != speculative:
        if speculative.is_enabled:
            logger.info("Speculative decoding flags (%s) override the recipe's (%s)", speculative, recipe.speculative)
        else:
            speculative = recipe.speculative
    resolved = replace(
        config,
        lora=_lora(config, recipe),
        model=recipe.model_path,  # the checkpoint the recipe was checked against is the one that runs
        device=recipe.device,
        quantization=recipe.quantization,
        quantization_group_size=recipe.quantization_group_size,
        activations=recipe.activations,
        second_form_memory_gb=_narrowest(config.second_form_memory_gb, recipe.second_form_memory_gb),
        dtype=recipe.dtype,
        max_model_len=max_model_len,
        cache=cache,
        scheduler=sched,
        recipe=recipe,
        parallel=parallel,
        speculative=speculative,
    )
    _refuse_contradictions(config, resolved, recipe)
    for name, _, old, new in _fields(config, resolved):
        if old != new:
            logger.info("Recipe %s sets %s=%s (was %s)", recipe.path, name, new, old)
    return resolved


def _refuse_contradictions(given: EngineConfig, resolved: EngineConfig, recipe: Recipe) -> None:
    """ConfigError naming every flag given (not at its default) whose value the recipe does not keep: a fact it was
    checked against that differs, or a bound raised past the recipe's (`min` kept the recipe's, so it differs too)."""
    defaults = EngineConfig()
    wrong = [
        f"{flag} {_shown(value)} (the recipe's {name} is {_shown(kept)})"
        for (name, flag, default, _), (_, _, value, kept) in zip(
            _fields(defaults, defaults), _fields(given, resolved), strict=True
        )
        if flag is not None and value != default and value != kept
    ]
    if wrong:
        raise ConfigError(
            f"{'; '.join(wrong)}: the recipe {recipe.path} is the contract the engine is checked against; drop the "
            "flag or change the recipe (a flag may narrow a bound, never raise it)"
        )


def _lora(config: EngineConfig, recipe: Recipe) -> LoRAConfig:
    """The recipe's lora section sizes the adapters' buffers (a fact the graphs are captured over): --enable-lora,
    --max-loras, --max-lora-rank and --lora-dtype given otherwise are refused; --lora-modules and --max-cpu-loras
    stay the flags'."""
    lora = recipe.lora
    if lora is None:
        return config.lora
    return replace(
        config.lora,
        enabled=True,
        max_loras=lora.max_loras,
        max_lora_rank=lora.max_lora_rank,
        target_modules=lora.target_modules,
        dtype=lora.dtype,
    )


def _narrowest(flag: float | None, recipe: float | None) -> float | None:
    """A bound the flag may narrow but not raise: the smaller of the two given (None: not given)."""
    given = [v for v in (flag, recipe) if v is not None]
    return min(given) if given else None


def _shown(value: object) -> str:
    return "none" if value is None else str(value)


def _fields(before: EngineConfig, after: EngineConfig) -> list[tuple[str, str | None, object, object]]:
    """(field, the flag that sets it or None, its value in `before`, in `after`) for every field the recipe
    overlays."""
    b, a = before, after
    bs, as_ = b.scheduler, a.scheduler
    return [
        ("device", "--device", b.device, a.device),
        ("quantization", "--quantization", b.quantization, a.quantization),
        ("quantization group size", "--quantization-group-size", b.quantization_group_size, a.quantization_group_size),
        ("activations", "--activations", b.activations, a.activations),
        ("second_form_memory_gb", "--second-form-memory-gb", b.second_form_memory_gb, a.second_form_memory_gb),
        ("dtype", "--dtype", b.dtype, a.dtype),
        ("max_model_len", "--max-model-len", b.max_model_len, a.max_model_len),
        ("kv_cache.dtype", "--kv-cache-dtype", b.cache.dtype, a.cache.dtype),
        ("kv_cache.block_size", "--block-size", b.cache.block_size, a.cache.block_size),
        ("kv_cache.num_blocks", "--num-kv-blocks", b.cache.num_blocks, a.cache.num_blocks),
        ("kv_cache.prefix_caching", None, b.cache.enable_prefix_caching, a.cache.enable_prefix_caching),
        ("max_num_seqs", "--max-num-seqs", bs.max_num_seqs, as_.max_num_seqs),
        ("max_num_batched_tokens", "--max-num-batched-tokens", bs.max_num_batched_tokens, as_.max_num_batched_tokens),
        ("parallel.tensor", "--tensor-parallel-size", b.parallel.tensor, a.parallel.tensor),
        ("parallel.pipeline", "--pipeline-parallel-size", b.parallel.pipeline, a.parallel.pipeline),
        ("parallel.stage_layers", None, b.parallel.stage_layers, a.parallel.stage_layers),
        ("speculative", None, b.speculative, a.speculative),
        ("lora.enabled", "--enable-lora", b.lora.enabled, a.lora.enabled),
        ("lora.max_loras", "--max-loras", b.lora.max_loras, a.lora.max_loras),
        ("lora.max_rank", "--max-lora-rank", b.lora.max_lora_rank, a.lora.max_lora_rank),
        ("lora.target_modules", None, b.lora.target_modules, a.lora.target_modules),
        ("lora.dtype", "--lora-dtype", b.lora.dtype, a.lora.dtype),
    ]
