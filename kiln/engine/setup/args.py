"""`EngineArgs`: every engine option in one dataclass, which generates the CLI flags and the `EngineConfig`.

Every entry point builds its engine the same way: flags (or `LLM(**kwargs)`) -> `EngineArgs` ->
`kiln.engine.setup.resolve.resolve_engine_config(args)` (the recipe, when given, is validated and overlaid there,
once, each change logged; the environment fills what neither sets) -> `kiln.engine.setup.build.build_engine(config)`.
A subcommand that loads a model calls `EngineArgs.add_cli_args`, so every such subcommand accepts exactly these
flags with the same meaning.

This module must stay light (no torch): `kiln --help` builds every subcommand's parser from it.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from kiln.compile.modes import PieceMode
from kiln.config import (
    ACTIVATION_NAMES,
    COMPILER_NAMES,
    DEFAULT_ACTIVATIONS,
    DTYPE_NAMES,
    KV_CACHE_DTYPE_NAMES,
    LORA_DTYPE_NAMES,
    POOLING_NAMES,
    QUANTIZATION_NAMES,
    SCHEDULING_POLICIES,
    LoRAConfig,
    SpeculativeConfig,
)
from kiln.engine.scheduling.prefix_cache import HASH_ALGOS
from kiln.engine.setup.arg_types import add_flags, fraction, int_at_least, non_negative, option, parse_sizes
from kiln.engine.structured.grammar_cache import GRAMMAR_CACHE_BYTES
from kiln.errors import ConfigError
from kiln.graph_mode import GRAPH_MODES
from kiln.speculative_config import SPECULATIVE_METHODS, SPECULATIVE_POLICIES

SPEC = "speculative decoding"  # the flags' group


@dataclass(frozen=True)
class EngineArgs:
    model: str = option(
        "default", "a .gguf file, an HF directory, or 'default' (SmolLM2-135M; with --recipe, its model.path)"
    )
    dtype: str = option("float32", "weight and activation dtype", choices=DTYPE_NAMES)
    device: str = option("cpu", "where the model runs", choices=("cpu", "cuda"))
    quantization: str = option(
        "auto",
        "auto: packed for a block-quantized GGUF or a quantized HF checkpoint, else none; none: dequantize weights "
        "to --dtype (the reference); packed: keep a GGUF's Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K blocks, or the int codes of "
        "a compressed-tensors/GPTQ/AWQ checkpoint, packed; int8/int4: quantize the decoder's linear weights at load "
        "(groups of 32; over a quantized checkpoint, only the width it holds, which keeps its codes packed)",
        choices=QUANTIZATION_NAMES,
    )
    quantization_group_size: int = option(
        32, "values per scale/offset group of --quantization int8|int4 (even, dividing the layers' input sizes)"
    )
    activations: str = option(
        DEFAULT_ACTIVATIONS,
        "activations of packed products: int8x2 (two int8 digits, about 15 bits) or int8 (one digit, llama.cpp's "
        "arithmetic: faster, less exact), quantized per weight group for kiln's native integer kernels; or float32 "
        "(the dequantize-then-fp32 arithmetic)",
        choices=ACTIVATION_NAMES,
    )
    second_form_memory_gb: float | None = option(
        None,
        "GB that second forms of packed weights (and of an unquantized logits head beside them) may take (a bf16 "
        "copy for the matrix unit, used by the row counts where it was timed fastest; default: half the memory free "
        "after the weights and the KV cache; 0: none)",
        type=non_negative,
    )
    max_model_len: int | None = option(None, "longest prompt + output in tokens (default: min(model context, 8192))")
    seed: int | None = option(
        None, "engine seed: requests without a seed draw theirs from it (default: fresh randomness every start)"
    )
    num_threads: int | None = option(None, "torch intra-op threads (default: all cores, or KILN_NUM_THREADS)")
    recipe: str | None = option(None, "recipe YAML: validated, then its settings and guards apply")
    block_size: int = option(16, "KV cache block size in tokens", group="KV cache", type=int_at_least(1))
    num_kv_blocks: int | None = option(None, "KV cache blocks (default: the memory flags' worth)", group="KV cache")
    kv_cache_memory_gb: float | None = option(
        None, "KV cache size in GB (default 1, unless --kv-cache-memory-fraction); --num-kv-blocks wins", "KV cache"
    )
    kv_cache_memory_fraction: float | None = option(
        None,
        "KV cache as this fraction of the memory available once the weights are loaded (vLLM's "
        "--gpu-memory-utilization, of free memory; CPU: RAM); --num-kv-blocks and a recipe's pages win",
        "KV cache",
        type=fraction,
    )
    enable_prefix_caching: bool = option(
        True, "reuse the KV blocks of any cached prompt prefix", "KV cache", action=argparse.BooleanOptionalAction
    )
    prefix_caching_hash_algo: str = option(
        "sha256", "cached blocks' key (builtin: faster, still compared by tokens)", "KV cache", choices=HASH_ALGOS
    )
    kv_cache_dtype: str = option(
        "auto",
        "what the KV cache stores (vLLM's names): auto (the model's dtype; bfloat16 halves the bytes), "
        "float32, bfloat16, float16, or int8 / fp8_e4m3 codes with a float32 scale per token and head",
        "KV cache",
        choices=KV_CACHE_DTYPE_NAMES,
    )
    max_num_seqs: int = option(64, "most sequences in one step", group="scheduler", type=int_at_least(1))
    max_num_batched_tokens: int = option(2048, "most tokens in one step", group="scheduler", type=int_at_least(1))
    enable_chunked_prefill: bool = option(
        True, "split long prompts over steps", group="scheduler", action=argparse.BooleanOptionalAction
    )
    long_prefill_token_threshold: int = option(
        512,
        "with chunked prefill, most prompt tokens one request prefills in a step while others run or wait, so a "
        "long prompt delays their next token by one chunk (0: no cap)",
        "scheduler",
        type=int_at_least(0),
    )
    long_prefill_step_seconds: float = option(
        0.5,
        "with chunked prefill, the longest a step holding a prompt's chunk should take while other requests "
        "stream (its measured time): the chunk shrinks as its context grows and as the machine is slower, so a "
        "long prompt delays the others' next token by at most about this (0: the token threshold alone)",
        "scheduler",
        type=non_negative,
    )
    scheduling_policy: str = option(
        "fcfs",
        "which waiting request runs first and which running one is preempted when KV blocks run out: fcfs (by "
        "arrival) or priority (by each request's `priority`, lower first, then arrival; vLLM's semantics)",
        "scheduler",
        choices=SCHEDULING_POLICIES,
    )
    max_running_per_request: int | None = option(
        None,
        "most sequences of one client request (prompts x n) running at once, so one n=64 request cannot take "
        "every batch slot (default: half of --max-num-seqs)",
        "scheduler",
        type=int_at_least(1),
    )
    graph_mode: str | None = option(
        None,
        "which graphs run, as vLLM names them (default: the recipe's graph.mode, else full_and_piecewise: "
        "decode-only steps replay one full graph per size, attention included; mixed steps the pieces); eager: none",
        "graph mode",
        choices=GRAPH_MODES,
    )
    enforce_eager: bool = option(False, "the same as --graph-mode eager (vLLM's name)", group="graph mode")
    full_graph: bool = option(False, "the same as --graph-mode full", group="graph mode")
    enable_piecewise_graph: bool = option(
        False, "graph mode on (the default already: kept for old command lines; refused beside eager)", "graph mode"
    )
    compiler: str | None = option(None, "piece compiler (default inductor)", group="graph mode", choices=COMPILER_NAMES)
    capture_sizes: Sequence[int] | None = option(
        None, "num_tokens sizes to capture, e.g. 1,2,4,8,16,32", group="graph mode", type=parse_sizes
    )
    compile_sizes: Sequence[int] | None = option(
        None,
        "capture sizes also compiled for their static shape, e.g. 1,2, or none (default: CPU 1,2; GPU none)",
        group="graph mode",
        type=parse_sizes,
    )
    piece_modes: str | dict[int, str] | None = option(
        None, "per-piece modes, e.g. 0-3:captured,4:eager,5:compiled", group="graph mode"
    )
    cache_dir: str | None = option(None, "compile cache (default ~/.cache/kiln or KILN_CACHE_DIR)", group="graph mode")
    dump_dir: str | None = option(
        None, "write graph artifacts (pieces, graph.dot, lint, profile) here", group="graph mode"
    )
    default_piece_mode: str | None = option(
        None,
        "mode of the pieces --piece-modes does not name (default captured)",
        group="graph mode",
        choices=tuple(m.value for m in PieceMode),
    )

    grammar_cache_mb: int = option(
        GRAMMAR_CACHE_BYTES >> 20,
        "memory the compiled grammars of structured outputs may take, estimated from their size (least recently used "
        "evicted first); a grammar larger than all of it is refused",
        "structured outputs",
        type=int_at_least(1),
    )

    pooling: str = option(
        "last",
        "an embedding's vector (/v1/embeddings, LLM.embed) from the prompt's final hidden states: last (the last "
        "token's, vLLM's default for decoder models), mean (over the prompt's tokens) or cls (the first token's)",
        "embeddings",
        choices=POOLING_NAMES,
    )
    normalize_embeddings: bool = option(
        True, "L2-normalize embeddings (vLLM's default)", "embeddings", action=argparse.BooleanOptionalAction
    )

    speculative_method: str | None = option(
        None,
        "ngram: propose the tokens that followed the latest earlier occurrence of the sequence's last n tokens in its "
        "prompt and output; draft: a smaller model (--speculative-model) proposes them; the model verifies them in "
        "one step (default: off)",
        SPEC,
        choices=SPECULATIVE_METHODS,
    )
    speculative_model: str | None = option(
        None, "draft: the draft model (a .gguf file, an HF directory or 'default'), same vocabulary", SPEC
    )
    num_speculative_tokens: int = option(
        4, "most draft tokens a sequence verifies per step", SPEC, type=int_at_least(1)
    )
    prompt_lookup_max: int = option(4, "ngram: the longest suffix searched for", SPEC, type=int_at_least(1))
    prompt_lookup_min: int = option(2, "ngram: the shortest suffix searched for", SPEC, type=int_at_least(1))
    speculative_policy: str = option(
        "measured",
        "which proposals a step verifies: measured (those that raise tokens/s by the step costs timed here) or always",
        SPEC,
        choices=SPECULATIVE_POLICIES,
    )

    enable_lora: bool = option(False, "serve LoRA adapters (PEFT checkpoints) beside the base model", "LoRA")
    lora_modules: Sequence[str] | None = option(
        None,
        "adapters registered at start, as name=path (a PEFT adapter directory); a request selects one by name",
        "LoRA",
        nargs="+",
    )
    max_loras: int = option(1, "most adapters in one step (one slot each)", "LoRA", type=int_at_least(1))
    max_lora_rank: int = option(16, "highest adapter rank accepted (the buffers' size)", "LoRA", type=int_at_least(1))
    max_cpu_loras: int | None = option(
        None,
        "adapters kept read in host memory, least recently used out (default: --max-loras)",
        "LoRA",
        type=int_at_least(1),
    )
    lora_dtype: str = option(
        "auto",
        "the adapters' buffers: auto (the model's dtype; bfloat16 over int8/int4 weights), float32, or bfloat16 "
        "(half the bytes; products in float32)",
        "LoRA",
        choices=LORA_DTYPE_NAMES,
    )

    tensor_parallel_size: int = option(
        1,
        "ranks that split every layer (heads, MLP, vocabulary) over torch.distributed",
        "parallel",
        type=int_at_least(1),
    )
    pipeline_parallel_size: int = option(
        1, "stages of contiguous layers, one per rank group", "parallel", type=int_at_least(1)
    )
    pipeline_micro_batches: int = option(
        0,
        "parts each step is split into so pipeline stages overlap (0: one per stage, or 1 with steps in flight)",
        "parallel",
    )
    pipeline_steps_in_flight: int = option(
        0,
        "steps of disjoint sequences kept in flight on a pipeline, so every stage works (0: one per stage; 1: none)",
        "parallel",
    )
    nnodes: int = option(1, "machines the ranks span (each runs kiln serve with its --node-rank)", "parallel")
    node_rank: int = option(0, "this machine's index among --nnodes", "parallel")
    master_addr: str = option("127.0.0.1", "address of node 0, where the ranks meet", "parallel")
    master_port: int = option(
        0, "port on node 0 where the ranks meet (0: a free one on one node, 29500 on several)", "parallel"
    )

    # -- the CLI ---------------------------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add one flag per field (`--max-model-len` for `max_model_len`), grouped, with help and defaults."""
        add_flags(parser, EngineArgs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> EngineArgs:
        """The engine arguments the parsed flags give; `overrides` (field names) win over the flags."""
        values = {f.name: getattr(args, f.name) for f in fields(cls)}
        return cls(**{**values, **overrides})

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """`LLM(**kwargs)`'s arguments, with a clear error for a name that is not an engine option."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ConfigError(f"unknown engine options {unknown}: expected some of {sorted(names)}")
        return cls(**kwargs)

    # -- what resolution reads (kiln.engine.setup.resolve) ----------------------------------------------------
    def given(self) -> set[str]:
        """The options set to something other than their default."""
        return {f.name for f in fields(self) if getattr(self, f.name) != f.default}

    def speculative_config(self) -> SpeculativeConfig:
        """Speculative decoding as the flags set it (off unless --speculative-method)."""
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low > high:
            raise ConfigError(f"--prompt-lookup-min {low} is above --prompt-lookup-max {high}")
        config = SpeculativeConfig(
            method=self.speculative_method,
            num_speculative_tokens=self.num_speculative_tokens,
            prompt_lookup_max=high,
            prompt_lookup_min=low,
            policy=self.speculative_policy,
            draft_model=self.speculative_model,
        )
        if problem := config.problem():
            raise ConfigError(problem)
        return config

    def lora_config(self) -> LoRAConfig:
        """LoRA as the flags set it: `--lora-modules name=path ...` read here (ConfigError naming a bad entry)."""
        modules = []
        for entry in self.lora_modules or ():
            name, sep, path = entry.partition("=")
            if not sep or not name or not path:
                raise ConfigError(f"--lora-modules {entry!r}: expected name=path (a PEFT adapter directory)")
            modules.append((name, path))
        names = [name for name, _ in modules]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ConfigError(f"--lora-modules names adapter {twice[0]} twice: give each name once")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"--max-cpu-loras {self.max_cpu_loras} is below --max-loras {self.max_loras}")
        return LoRAConfig(
            enabled=self.enable_lora,
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
            max_cpu_loras=self.max_cpu_loras,
            modules=tuple(modules),
            dtype=self.lora_dtype,
        )
