"""Engine flags that would do nothing are refused, not ignored: every option acts or says why it cannot.

A flag given (a value other than its default) is checked against the resolved `EngineConfig` (the recipe overlaid):
options of the graphs under `--graph-mode eager`, speculation's tuning without a method, a group size or
activations where no quantized product runs, a KV cache size that other settings override, the pipeline's and the
rendezvous' options on one process, the prefill chunk's budget without chunked prefill, the prefix cache's hash
without the prefix cache. The recipe refuses the same settings in its own terms (kiln.recipe.contract), and
`kiln serve` its own flags (kiln.server.launcher.inert_serve_flags).

This module must stay light (no torch): it runs while the flags are read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kiln.config import EngineConfig
from kiln.errors import ConfigError

# the graph options that only act when pieces are traced
GRAPH_OPTIONS = ("compiler", "capture_sizes", "compile_sizes", "piece_modes", "default_piece_mode", "dump_dir")
SPECULATION_TUNING = ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "speculative_policy")
NGRAM_ONLY = ("prompt_lookup_max", "prompt_lookup_min")
PIPELINE_OPTIONS = ("pipeline_micro_batches", "pipeline_steps_in_flight")
RENDEZVOUS_OPTIONS = ("nnodes", "node_rank", "master_addr", "master_port")
CHUNK_BUDGET = ("long_prefill_token_threshold", "long_prefill_step_seconds")
LORA_OPTIONS = ("lora_modules", "max_loras", "max_lora_rank", "max_cpu_loras", "lora_dtype")

Rule = Callable[[set[str], EngineConfig], Iterable[str]]


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _graph(given: set[str], config: EngineConfig) -> Iterable[str]:
    if not config.graph.mode.is_graph:
        for name in GRAPH_OPTIONS:
            if name in given:
                yield f"{flag(name)} does nothing under graph mode eager (no piece is traced): drop it or pick a mode"


def _speculation(given: set[str], config: EngineConfig) -> Iterable[str]:
    method = config.speculative.method
    if method is None:
        for name in SPECULATION_TUNING:
            if name in given:
                yield f"{flag(name)} does nothing without --speculative-method (speculation is off): drop it or set one"
    elif method != "ngram":
        for name in NGRAM_ONLY:
            if name in given:
                yield f"{flag(name)} tunes the ngram method only, not {method}: drop it"


def _quantization(given: set[str], config: EngineConfig) -> Iterable[str]:
    quantization = config.quantization
    if "quantization_group_size" in given and quantization not in ("int8", "int4"):
        yield (
            f"--quantization-group-size does nothing with --quantization {quantization}: it sizes the groups of "
            "weights kiln quantizes at load (int8, int4); a GGUF's packed blocks keep their own"
        )
    # NOTE: float32 activations are what unquantized weights run with anyway: asking for them is never refused
    quantized_activations = config.activations != "float32"
    if "activations" in given and quantized_activations and (quantization == "none" or config.device != "cpu"):
        where = "without quantized weights (--quantization none)" if quantization == "none" else "off the CPU"
        yield f"--activations does nothing {where}: it sets the activations of kiln's CPU kernels for quantized weights"
    if "second_form_memory_gb" in given and (quantization == "none" or config.device != "cpu"):
        yield "--second-form-memory-gb does nothing without packed or quantized weights on the CPU: drop it"


def _kv_cache(given: set[str], config: EngineConfig) -> Iterable[str]:
    sizes = [name for name in ("kv_cache_memory_gb", "kv_cache_memory_fraction") if name in given]
    if "num_kv_blocks" in given:
        winner = "--num-kv-blocks"
    elif config.cache.num_blocks:
        winner = "the recipe's memory_plan.kv_cache.max_pages"
    elif len(sizes) == 2:
        winner, sizes = "--kv-cache-memory-gb", ["kv_cache_memory_fraction"]
    else:
        return
    for name in sizes:
        yield f"{flag(name)} does nothing beside {winner}, which sets the KV cache's size: drop one of them"


def _parallel(given: set[str], config: EngineConfig) -> Iterable[str]:
    parallel = config.parallel
    if parallel.pipeline == 1:
        for name in PIPELINE_OPTIONS:
            if name in given:
                yield f"{flag(name)} does nothing without pipeline stages (--pipeline-parallel-size 1): drop it"
    if parallel.world_size == 1:
        for name in RENDEZVOUS_OPTIONS:
            if name in given:
                yield f"{flag(name)} does nothing in one process (tensor and pipeline parallel sizes 1): drop it"


def _scheduler(given: set[str], config: EngineConfig) -> Iterable[str]:
    if not config.scheduler.enable_chunked_prefill:
        for name in CHUNK_BUDGET:
            if name in given:
                yield f"{flag(name)} does nothing without chunked prefill (--no-enable-chunked-prefill): drop one"
    if not config.cache.enable_prefix_caching and "prefix_caching_hash_algo" in given:
        yield "--prefix-caching-hash-algo does nothing without prefix caching (--no-enable-prefix-caching): drop one"


def _lora(given: set[str], config: EngineConfig) -> Iterable[str]:
    if not config.lora.enabled:
        for name in LORA_OPTIONS:
            if name in given:
                yield f"{flag(name)} does nothing without --enable-lora (adapters are off): drop it or enable them"


RULES: tuple[Rule, ...] = (_graph, _speculation, _quantization, _kv_cache, _parallel, _scheduler, _lora)


def inert_options(given: set[str], config: EngineConfig) -> list[str]:
    """Why each given option (field names of EngineArgs) does nothing in `config`: one line each."""
    return [line for rule in RULES for line in rule(given, config)]


def refuse_inert(given: set[str], config: EngineConfig) -> None:
    """ConfigError naming every given option that does nothing in `config`."""
    if lines := inert_options(given, config):
        raise ConfigError("; ".join(lines))
