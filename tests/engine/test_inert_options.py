"""Every engine option acts or is refused (issue 53, item 6): a walk over every field of EngineArgs shows each one
changing the EngineConfig in a setting where it applies, and each option that would do nothing (graph options under
eager, speculation's tuning without a method, a group size without load-time quantization, KV sizes another
setting overrides, pipeline and rendezvous options in one process, the chunk budget without chunked prefill, the
prefix cache's hash without the prefix cache) is refused with a message naming the flag and why."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from kiln.config import EngineConfig
from kiln.engine.setup.args import EngineArgs
from kiln.engine.setup.resolve import resolve_engine_config, resolve_for_model
from kiln.errors import ConfigError
from kiln.model.loader import open_checkpoint

RECIPE = """\
recipe_version: 1
model: {name: smollm2-135m-instruct}
weights: {source_quantization: q4_1}
input_constraints:
  constraints: [seq_len <= 1024, num_tokens <= 32]
graph: {mode: piecewise, capture_sizes: [1, 2, 4]}
hardware: {device: cpu}
"""
NGRAM = {"speculative_method": "ngram"}
TWO_RANKS = {"tensor_parallel_size": 2}
PIPELINE = {"pipeline_parallel_size": 2}
LORA = {"enable_lora": True}

# each option: a value, and the other options that make a setting where it acts
ACTS: dict[str, tuple[Any, dict[str, Any]]] = {
    "model": ("other.gguf", {}),
    "dtype": ("bfloat16", {}),
    "device": ("cuda", {}),
    "quantization": ("int8", {}),
    "quantization_group_size": (64, {"quantization": "int8"}),
    "activations": ("int8", {"quantization": "packed"}),
    "second_form_memory_gb": (1.0, {}),
    "max_model_len": (256, {}),
    "seed": (1, {}),
    "num_threads": (3, {}),  # not the suite's KILN_NUM_THREADS, which resolution reads when the flag is not given
    "recipe": ("RECIPE", {}),
    "block_size": (32, {}),
    "num_kv_blocks": (8, {}),
    "kv_cache_memory_gb": (2.0, {}),
    "kv_cache_memory_fraction": (0.5, {}),
    "enable_prefix_caching": (False, {}),
    "prefix_caching_hash_algo": ("builtin", {}),
    "kv_cache_dtype": ("bfloat16", {}),
    "max_num_seqs": (8, {}),
    "max_num_batched_tokens": (1024, {}),
    "enable_chunked_prefill": (False, {}),
    "long_prefill_token_threshold": (256, {}),
    "long_prefill_step_seconds": (0.2, {}),
    "max_running_per_request": (4, {}),
    "scheduling_policy": ("priority", {}),
    "graph_mode": ("piecewise", {}),
    "enforce_eager": (True, {}),
    "full_graph": (True, {}),
    "enable_piecewise_graph": (True, {}),
    "compiler": ("eager", {}),
    "capture_sizes": ((1, 2), {}),
    "compile_sizes": ((1,), {}),
    "piece_modes": ("0:eager", {}),
    "cache_dir": ("/tmp/kiln-walk-cache", {}),
    "dump_dir": ("/tmp/kiln-walk-dump", {}),
    "default_piece_mode": ("eager", {}),
    "grammar_cache_mb": (64, {}),
    "pooling": ("mean", {}),
    "normalize_embeddings": (False, {}),
    "speculative_method": ("ngram", {}),
    "speculative_model": ("default", {"speculative_method": "draft"}),
    "num_speculative_tokens": (2, NGRAM),
    "prompt_lookup_max": (3, NGRAM),
    "prompt_lookup_min": (1, NGRAM),
    "speculative_policy": ("always", NGRAM),
    "enable_lora": (True, {}),
    "lora_modules": (["a=/adapters/a"], LORA),
    "max_loras": (2, LORA),
    "max_lora_rank": (8, LORA),
    "max_cpu_loras": (4, LORA),
    "lora_dtype": ("bfloat16", LORA),
    "tensor_parallel_size": (2, {}),
    "pipeline_parallel_size": (2, {}),
    "pipeline_micro_batches": (2, PIPELINE),
    "pipeline_steps_in_flight": (2, PIPELINE),
    "nnodes": (2, TWO_RANKS),
    "node_rank": (1, {**TWO_RANKS, "nnodes": 2}),
    "master_addr": ("127.0.0.2", TWO_RANKS),
    "master_port": (29600, TWO_RANKS),
}


def config(**options: Any) -> EngineConfig:
    return resolve_engine_config(EngineArgs(**options))


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("recipe") / "walk.yaml"
    path.write_text(RECIPE)
    return path


def test_the_walk_names_every_option() -> None:
    assert sorted(ACTS) == sorted(f.name for f in fields(EngineArgs))


@pytest.mark.parametrize("name", sorted(ACTS))
def test_every_option_changes_the_config_where_it_applies(name: str, recipe: Path) -> None:
    value, context = ACTS[name]
    value = str(recipe) if value == "RECIPE" else value
    if name == "speculative_model":  # the draft method needs its model: the setting without it is the method off
        assert config(**{name: value, **context}).speculative.draft_model == value
        return
    if name == "enable_piecewise_graph":  # asks for graph mode, the default already: it acts by refusing eager
        with pytest.raises(ConfigError, match="--enable-piecewise-graph asks for graph mode"):
            config(enable_piecewise_graph=True, recipe=str(eager_recipe(recipe.parent)))
        return
    assert config(**{**context, name: value}) != config(**context)


REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "capture sizes under eager": ({"graph_mode": "eager", "capture_sizes": (1, 2)}, "--capture-sizes"),
    "the compiler under eager": ({"enforce_eager": True, "compiler": "eager"}, "--compiler"),
    "piece modes under eager": ({"graph_mode": "eager", "piece_modes": "0:eager"}, "--piece-modes"),
    "a dump dir under eager": ({"graph_mode": "eager", "dump_dir": "/tmp/d"}, "--dump-dir"),
    "compile sizes under eager": ({"graph_mode": "eager", "compile_sizes": (1,)}, "--compile-sizes"),
    "default piece mode under eager": ({"graph_mode": "eager", "default_piece_mode": "eager"}, "--default-piece-mode"),
    "draft tokens without a method": ({"num_speculative_tokens": 2}, "--num-speculative-tokens"),
    "lookup without a method": ({"prompt_lookup_max": 3}, "--prompt-lookup-max"),
    "a policy without a method": ({"speculative_policy": "always"}, "--speculative-policy"),
    "lookup with a draft model": (
        {"speculative_method": "draft", "speculative_model": "default", "prompt_lookup_min": 1},
        "--prompt-lookup-min",
    ),
    "adapter slots without LoRA": ({"max_loras": 2}, "--max-loras does nothing without --enable-lora"),
    "adapters without LoRA": ({"lora_modules": ["a=/x"]}, "--lora-modules does nothing without --enable-lora"),
    "a group size on packed blocks": ({"quantization": "packed", "quantization_group_size": 64}, "group-size"),
    "activations without quantized weights": ({"quantization": "none", "activations": "int8"}, "--activations"),
    "second forms without quantized weights": ({"quantization": "none", "second_form_memory_gb": 1.0}, "second-form"),
    "KV GB beside KV blocks": ({"num_kv_blocks": 8, "kv_cache_memory_gb": 2.0}, "--kv-cache-memory-gb"),
    "a KV fraction beside KV GB": (
        {"kv_cache_memory_gb": 2.0, "kv_cache_memory_fraction": 0.5},
        "--kv-cache-memory-fraction",
    ),
    "micro-batches without stages": ({"pipeline_micro_batches": 2}, "--pipeline-micro-batches"),
    "steps in flight under TP only": (
        {"tensor_parallel_size": 2, "pipeline_steps_in_flight": 2},
        "--pipeline-steps-in-flight",
    ),
    "nodes in one process": ({"nnodes": 2}, "--nnodes"),
    "a master port in one process": ({"master_port": 29600}, "--master-port"),
    "a chunk threshold without chunking": (
        {"enable_chunked_prefill": False, "long_prefill_token_threshold": 256},
        "--long-prefill-token-threshold",
    ),
    "a chunk time without chunking": (
        {"enable_chunked_prefill": False, "long_prefill_step_seconds": 0.2},
        "--long-prefill-step-seconds",
    ),
    "a hash without the prefix cache": (
        {"enable_prefix_caching": False, "prefix_caching_hash_algo": "builtin"},
        "--prefix-caching-hash-algo",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_an_option_that_would_do_nothing_is_refused_by_name(case: str) -> None:
    options, named = REFUSED[case]
    with pytest.raises(ConfigError, match=named) as refused:
        config(**options)
    assert "does nothing" in str(refused.value) or "tunes the ngram method only" in str(refused.value)


def test_a_recipes_pages_make_the_kv_flags_inert(tmp_path: Path) -> None:
    paged = tmp_path / "paged.yaml"
    paged.write_text(RECIPE + "memory_plan: {kv_cache: {max_pages: 64}}\n")
    assert config(recipe=str(paged)).cache.num_blocks == 64
    with pytest.raises(ConfigError, match="--kv-cache-memory-gb does nothing beside the recipe's"):
        config(recipe=str(paged), kv_cache_memory_gb=2.0)


def eager_recipe(folder: Path) -> Path:
    eager = folder / "eager.yaml"
    eager.write_text(RECIPE.replace("mode: piecewise, capture_sizes: [1, 2, 4]", "mode: eager"))
    return eager


def test_a_recipes_eager_mode_makes_the_graph_flags_inert(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--compiler does nothing under graph mode eager"):
        config(recipe=str(eager_recipe(tmp_path)), compiler="eager")


def test_commands_deriving_an_engine_of_their_own_may_skip_the_check() -> None:
    derived = resolve_engine_config(EngineArgs(graph_mode="eager", capture_sizes=(1, 2)), refuse_inert_options=False)
    assert not derived.graph.mode.is_graph


def test_an_option_the_checkpoint_leaves_inert_is_refused_once_it_decides() -> None:
    """`--quantization auto` is decided by the checkpoint: where its weights run unquantized (an fp32 or bf16 HF
    checkpoint), `--activations` has no quantized product to act on and is refused then; where they stay packed it
    acts. A command's derived config (nothing the user must see act) is not checked."""
    model_config = open_checkpoint("default").config
    asked = config(activations="int8")
    assert asked.quantization == "auto" and "activations" in asked.must_act
    with pytest.raises(ConfigError, match="--activations does nothing without quantized weights"):
        resolve_for_model(asked, model_config, lambda quantization: "none")
    assert resolve_for_model(asked, model_config, lambda quantization: "packed").activations == "int8"
    plain = config(activations="float32")  # what unquantized weights run with anyway: a script may ask it everywhere
    assert resolve_for_model(plain, model_config, lambda quantization: "none").activations == "float32"
    derived = resolve_engine_config(EngineArgs(activations="int8"), refuse_inert_options=False)
    assert resolve_for_model(derived, model_config, lambda quantization: "none").quantization == "none"
