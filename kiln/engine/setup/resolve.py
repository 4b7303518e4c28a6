"""One configuration resolution: the flags (`EngineArgs`), the recipe and the environment become one `EngineConfig` of
resolved values, which every entry point (CLI, `LLM`, server, bench, debugger) builds its engine from.

The precedence, one for every value, highest first:

1. **A flag given** (set to something other than its default). On a setting of how the model runs (graph mode and
   the graph settings, speculative decoding) it wins over the recipe, and says so in the log; on a bound
   (max_model_len, max_num_seqs, max_num_batched_tokens, second_form_memory_gb) it may narrow the recipe's, never
   raise it; on a fact the recipe was checked against (device, dtype, quantization, its group size and activations,
   the KV cache plan, the parallel layout) it is refused where it differs (kiln.engine.setup.recipe_config).
   `--graph-mode` and its aliases (`--enforce-eager`, `--full-graph`) name one mode; two that disagree are refused.
2. **The recipe** (`--recipe`): validated once, then overlaid; every value it changes is logged.
3. **The environment** (kiln.env, read here and nowhere else on the way to an engine): KILN_CACHE_DIR the compile
   and kernel-choice cache, KILN_NUM_THREADS torch's threads, KILN_DEBUG the graph trace level (it raises the
   recipe's `debug.debug_mode`, never lowers it).
4. **kiln's defaults**, and what the checkpoint says: max_model_len min(model context, 8192), quantization `auto`
   packed for a block-quantized GGUF, else none.

`resolve_engine_config` does 1-3 (and 4 where no checkpoint is needed); `resolve_for_model`, called by
`kiln.engine.setup.build.build_core` once the checkpoint is open, does the rest: an engine is built from a config
whose graph mode, max_model_len (the graph settings' too), quantization, cache dir and threads are all resolved, and
nothing below (kiln.compile, kiln.executor) reads the environment or patches the config.

Light (no torch): the CLI resolves its config before anything loads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from kiln.compile.settings import graph_config_from
from kiln.config import (
    DEFAULT_MAX_MODEL_LEN,
    CacheConfig,
    EngineConfig,
    GraphConfig,
    ModelConfig,
    ParallelConfig,
    PoolingConfig,
    SchedulerConfig,
)
from kiln.engine.setup.inert_options import refuse_inert
from kiln.env import Env, read_env
from kiln.errors import ConfigError

if TYPE_CHECKING:
    from kiln.engine.setup.args import EngineArgs
    from kiln.recipe import Recipe

logger = logging.getLogger("kiln")


def resolve_engine_config(args: EngineArgs, refuse_inert_options: bool = True, env: Env | None = None) -> EngineConfig:
    """The EngineConfig `args` describe, with the recipe (if any) validated and overlaid once and the environment
    (`env`, default: this process's) filling what neither sets (see the module's precedence). An option given that
    would do nothing there is refused (kiln.engine.setup.inert_options), unless `refuse_inert_options` is false:
    arguments a command derived from the user's for an engine of its own (the debugger's sessions, a bench's eager
    mode), whose options the user's own engine uses."""
    env = env or read_env()
    recipe = _load_recipe(args)
    graph = _graph_config(args, recipe, env)
    if args.enable_piecewise_graph and not graph.mode.is_graph:
        raise ConfigError(
            f"--enable-piecewise-graph asks for graph mode but {recipe.path if recipe else 'the flags'} "
            "set graph mode eager; drop one of them"
        )
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        quantization=args.quantization,
        quantization_group_size=args.quantization_group_size,
        activations=args.activations,
        second_form_memory_gb=args.second_form_memory_gb,
        max_model_len=args.max_model_len,
        seed=args.seed,
        num_threads=args.num_threads or env.num_threads,
        cache=_cache_config(args),
        scheduler=_scheduler_config(args),
        graph=graph,
        parallel=_parallel_config(args),
        speculative=args.speculative_config(),
        grammar_cache_bytes=args.grammar_cache_mb << 20,
        pooling=PoolingConfig(args.pooling, args.normalize_embeddings),
        lora=args.lora_config(),
    )
    if recipe is not None:
        # NOTE: lazy, as the recipe: pydantic and z3 load only when a recipe is used
        from kiln.engine.setup.recipe_config import overlay_recipe

        config = overlay_recipe(config, recipe)
    if config.speculative.is_enabled and config.parallel.is_distributed:
        raise ConfigError("speculative decoding runs on one device for now: drop it or the parallel layout")
    if refuse_inert_options:
        config = replace(config, must_act=frozenset(args.given()))
        refuse_inert(config.must_act, config)
    return config


def no_checkpoint(asked: str) -> str:
    """The quantization weights not read from a checkpoint run with (a model a factory made): `auto` is none."""
    return "none" if asked == "auto" else asked


def resolve_for_model(
    config: EngineConfig, model_config: ModelConfig, run_quantization: Callable[[str], str] = no_checkpoint
) -> EngineConfig:
    """`config` with what the checkpoint decides resolved (4. of the module's precedence): max_model_len (the
    graph settings' as well: a full decode graph's table width) and the quantization the weights run with
    (`run_quantization`: the checkpoint's answer to the quantization asked, kiln.model.build.run_quantization; e.g.
    `auto` is packed for a block-quantized GGUF). A config already resolved comes back unchanged."""
    max_model_len = config.max_model_len or min(model_config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    quantization = run_quantization(config.quantization)
    if quantization != config.quantization:
        logger.info("Quantization %s: %s for this checkpoint", config.quantization, quantization)
    graph = replace(config.graph, max_model_len=max_model_len)
    resolved = replace(config, max_model_len=max_model_len, quantization=quantization, graph=graph)
    if quantization != config.quantization:  # an option the checkpoint's weights leave with nothing to do
        refuse_inert(config.must_act, resolved)
    return resolved


def graph_mode_from_flags(
    graph_mode: str | None, enforce_eager: bool, full_graph: bool, enable_piecewise_graph: bool
) -> str | None:
    """The graph mode the flags name (None: none does), from --graph-mode or one of its aliases (each use of an
    alias logged); flags naming two modes are refused."""
    named = {
        "--graph-mode": graph_mode,
        "--enforce-eager": "eager" if enforce_eager else None,
        "--full-graph": "full" if full_graph else None,
    }
    given = {flag: mode for flag, mode in named.items() if mode is not None}
    if len(set(given.values())) > 1:
        listed = ", ".join(f"{flag} ({mode})" for flag, mode in given.items())
        raise ConfigError(f"the graph-mode flags disagree: {listed}; give one --graph-mode")
    for flag, mode in given.items():
        if flag != "--graph-mode":
            logger.info("%s is an alias of --graph-mode %s", flag, mode)
    if enable_piecewise_graph:
        logger.info("--enable-piecewise-graph: graph mode is on by default (kept as an alias)")
    return next(iter(given.values()), None)


def _load_recipe(args: EngineArgs) -> Recipe | None:
    if not args.recipe:
        return None
    # NOTE: lazy: pydantic and z3 load only when a recipe is used (and never for `kiln --help`).
    from kiln.recipe import load_recipe

    # NOTE: --model left at "default" runs the checkpoint the recipe names (model.path)
    return load_recipe(args.recipe, model=None if args.model == "default" else args.model)


def _graph_config(args: EngineArgs, recipe: Recipe | None, env: Env) -> GraphConfig:
    """The graph settings: the recipe's, the flags over them (logged), the environment's cache dir and trace level."""
    mode = graph_mode_from_flags(args.graph_mode, args.enforce_eager, args.full_graph, args.enable_piecewise_graph)
    graph = graph_config_from(
        recipe,
        mode=mode,
        compiler=args.compiler,
        capture_sizes=args.capture_sizes,
        compile_sizes=args.compile_sizes,
        piece_modes=args.piece_modes,
        cache_dir=args.cache_dir or str(env.cache_dir),
        dump_dir=args.dump_dir,
        default_piece_mode=args.default_piece_mode,
    )
    graph = replace(graph, debug=max(graph.debug, env.debug))
    if recipe is None and args.capture_sizes is None:  # NOTE: a recipe's or the flag's sizes are kept as given
        graph = replace(graph, capture_sizes=args.speculative_config().capture_sizes(graph.capture_sizes))
    return graph


def _cache_config(args: EngineArgs) -> CacheConfig:
    return CacheConfig(
        block_size=args.block_size,
        num_blocks=args.num_kv_blocks,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        dtype=args.kv_cache_dtype,
        kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_caching_hash_algo=args.prefix_caching_hash_algo,
    )


def _scheduler_config(args: EngineArgs) -> SchedulerConfig:
    return SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_running_per_request=args.max_running_per_request,
        long_prefill_step_seconds=args.long_prefill_step_seconds,
        policy=args.scheduling_policy,
    )


def _parallel_config(args: EngineArgs) -> ParallelConfig:
    return ParallelConfig(
        tensor=args.tensor_parallel_size,
        pipeline=args.pipeline_parallel_size,
        micro_batches=args.pipeline_micro_batches,
        steps_in_flight=args.pipeline_steps_in_flight,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
    )
