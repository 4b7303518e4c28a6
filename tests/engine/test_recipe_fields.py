"""Each honoured recipe field changes what the engine does: device, dtypes, KV cache plan, graph settings."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.compile.fusion_check import FusionGroupError
from kiln.config import SpeculativeConfig
from kiln.engine.setup.args import EngineArgs
from kiln.errors import ConfigError
from kiln.quant.linear import PackedLinear
from kiln.recipe.diagnostics import RecipeError

FIELDS = """\
recipe_version: 1
model: {name: smollm2-135m-instruct}
weights: {dtype: bfloat16, source_quantization: q4_1}
input_constraints: {constraints: [num_tokens <= 512, seq_len <= 256, batch_size <= 8]}
memory_plan: {kv_cache: {dtype: bfloat16, block_size: 8, max_pages: 64}}
graph: {piecewise: %s, capture_sizes: [1, 2, 8], compile_sizes: [1], compiler: inductor}
hardware: {device: cpu, arch: %s}
debug: {debug_mode: %s}
"""


def write(tmp_path: Path, piecewise: str = "false", debug: str = "false") -> str:
    arch = "x86_64" if torch.backends.cpu.get_cpu_capability() != "DEFAULT" else "null"
    path = tmp_path / "recipe.yaml"
    path.write_text(FIELDS % (piecewise, arch, debug))
    return str(path)


def test_graph_fields_and_device_reach_the_engine_config(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kiln"):
        config = EngineArgs(recipe=write(tmp_path, "true", debug="true")).create_engine_config()
    assert config.device == "cpu" and config.dtype == "bfloat16"  # the recipe's, and each change is logged
    assert "sets dtype=bfloat16 (was float32)" in caplog.text
    graph = config.graph
    assert (graph.capture_sizes, graph.compile_sizes, graph.compiler, graph.debug) == ((1, 2, 8), (1,), "inductor", 1)
    assert config.graph_mode == "full_and_piecewise" and config.executor == "graph"
    assert (config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs, config.max_model_len) == (
        512,
        8,
        256,
    )


def test_dtypes_and_kv_plan_change_the_engine(tmp_path: Path) -> None:
    llm = LLM(recipe=write(tmp_path), graph_mode="eager")  # the fields at stake shape the model and cache, not graphs
    engine = llm.engine
    assert next(engine.model.parameters()).dtype == torch.bfloat16  # weights.dtype
    assert {t.dtype for t in engine.runner.kv_caches} == {torch.bfloat16}  # kv_cache.dtype
    assert (engine.pool.block_size, engine.pool.num_blocks) == (8, 64)  # block_size, max_pages
    per_token = 2 * engine.model_config.num_kv_heads * engine.model_config.head_dim * 2  # K and V, 2 bytes each
    # 64 blocks and the null block (padding rows of a full decode graph write there)
    assert engine.runner.kv_cache_bytes == engine.model_config.num_layers * (64 + 1) * 8 * per_token
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=6, temperature=0))[0]
    assert out.finish_reason == "length" and "Paris" in out.text  # a bf16 model with a bf16 cache still answers


@pytest.mark.parametrize(
    ("weights", "group", "engine_mode", "scheme"), [("int4", 32, "packed", "gguf"), ("int8", 64, "int8", "int8")]
)
def test_the_recipe_quantization_runs(tmp_path: Path, weights: str, group: int, engine_mode: str, scheme: str) -> None:
    """int4 over the Q4_1 file keeps its blocks; int8 quantizes the dequantized weights at load, in the recipe's
    group size."""
    path = tmp_path / "recipe.yaml"
    text = (FIELDS % ("false", "null", "false")).replace("dtype: bfloat16, source", "dtype: float32, source")
    quant = f"quantization: {{weights: {weights}, group_size: {group}}}"
    path.write_text(text.replace("memory_plan:", f"{quant}\nmemory_plan:"))
    llm = LLM(recipe=str(path), graph_mode="eager")  # (packed layers in graph mode: tests/quant/test_packed.py)
    assert llm.engine.config.quantization == engine_mode
    packed = [m for m in llm.engine.model.model.layers.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == 4 * llm.engine.model_config.num_layers and {m.scheme for m in packed} == {scheme}
    assert {m.group for m in packed} == {group} and {m.scale.shape[1] * group for m in packed} == {576, 1536}
    # the file's blocks include the Q8_0 embedding and its tied head; load-time int8 leaves them in float
    assert isinstance(llm.engine.model.lm_head, PackedLinear) == (engine_mode == "packed")
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=6, temperature=0))[0]
    assert "Paris" in out.text


QUANTIZED_GROUP = """\
recipe_version: 1
model: {name: smollm2-135m-instruct}
weights: {dtype: float32, source_quantization: q4_1}
quantization: {weights: %s}
fusion_groups:
  - {name: mlp, ops: [gate_proj, up_proj, silu, mul], required: false, all_ops_quantized: %s}
input_constraints: {constraints: [num_tokens <= 512, seq_len <= 256, batch_size <= 8]}
hardware: {device: cpu}
"""


@pytest.mark.parametrize(
    ("weights", "claim", "runs"),
    [("none", "int4", "unquantized weights"), ("int8", "int4", "8-bit codes"), ("int4", "int4", None)],
)
def test_all_ops_quantized_is_checked_against_the_loaded_weights(
    tmp_path: Path, weights: str, claim: str, runs: str | None
) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(QUANTIZED_GROUP % (weights, claim))
    if runs is None:  # int4 over the Q4_1 file: the blocks run packed, 4-bit
        llm = LLM(recipe=str(path), graph_mode="piecewise")
        assert llm.engine.model.model.layers[0].mlp.gate_up_proj.bits == 4
        return
    with pytest.raises(FusionGroupError) as err:
        LLM(recipe=str(path), graph_mode="piecewise")
    assert str(err.value) == (
        f"{path}:6: fusion group mlp claims all_ops_quantized: int4, but gate_proj runs {runs} "
        "(model.layers.0.mlp.gate_up_proj); set quantization.weights, or drop the claim"
    )


@pytest.mark.parametrize(
    "graph,mode",
    [
        ("piecewise: false, mode: full", "full"),  # once validated and then run eagerly
        ("piecewise: false", "full"),  # no split: the whole forward is one graph
        ("piecewise: true", "full_and_piecewise"),
        ("piecewise: true, mode: piecewise", "piecewise"),
        ("piecewise: true, mode: full_decode_only", "full_decode_only"),
        ("piecewise: true, mode: full_and_piecewise", "full_and_piecewise"),
        ("mode: eager", "eager"),
        ("piecewise: false, mode: eager", "eager"),
    ],
)
def test_the_recipe_alone_names_the_graph_mode(tmp_path: Path, graph: str, mode: str) -> None:
    """No graph flag at all: the recipe's mode is what the engine builds (its executor included)."""
    path = Path(write(tmp_path))
    text = path.read_text().replace("piecewise: false", graph)
    if mode == "eager":  # the sizes and the compiler would do nothing: refused (kiln.recipe.contract.check_inert)
        text = text.replace(", capture_sizes: [1, 2, 8], compile_sizes: [1], compiler: inductor", "")
    path.write_text(text)
    config = EngineArgs(recipe=str(path)).create_engine_config()
    assert config.graph_mode == mode and config.executor == ("eager" if mode == "eager" else "graph")


def test_a_recipe_mode_that_runs_pieces_without_piecewise_is_refused_at_its_line(tmp_path: Path) -> None:
    path = Path(write(tmp_path))
    path.write_text(path.read_text().replace("piecewise: false", "piecewise: false, mode: piecewise"))
    line = next(i for i, t in enumerate(path.read_text().splitlines(), 1) if t.startswith("graph:"))
    with pytest.raises(RecipeError, match=rf"{path}:{line}:\d+: error: graph.mode piecewise runs pieces"):
        EngineArgs(recipe=str(path)).create_engine_config()


def test_one_precedence_for_every_field(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The recipe is the contract (kiln.engine.setup.recipe_config): a given flag may run it another way (graph
    settings, logged) or narrow a bound (logged); one that contradicts a fact the recipe was checked against, or raises
    a bound past it, is refused with the flag and both values named. A flag that agrees is no contradiction."""
    recipe = write(tmp_path)
    with pytest.raises(ConfigError) as refused:
        EngineArgs(recipe=recipe, device="cuda", max_num_seqs=16, dtype="bfloat16").create_engine_config()
    message = str(refused.value)
    assert "--device cuda (the recipe's device is cpu)" in message
    assert "--max-num-seqs 16 (the recipe's max_num_seqs is 8)" in message and "--dtype" not in message
    assert "recipe.yaml" in message
    with caplog.at_level(logging.INFO, logger="kiln"):
        config = EngineArgs(
            recipe=recipe, max_num_seqs=4, capture_sizes=(1, 4), max_model_len=128
        ).create_engine_config()
    assert (config.scheduler.max_num_seqs, config.max_model_len, config.graph.capture_sizes) == (4, 128, (1, 4))
    assert "Graph setting capture_sizes=(1, 4) overrides the recipe's (1, 2, 8)" in caplog.text
    with pytest.raises(ConfigError, match=r"--block-size 32 \(the recipe's kv_cache.block_size is 8\)"):
        EngineArgs(recipe=recipe, block_size=32).create_engine_config()


def test_the_recipe_speculative_section_and_the_flags_over_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = Path(write(tmp_path))
    path.write_text(
        path.read_text() + "speculative: {method: ngram, num_speculative_tokens: 3, prompt_lookup_min: 1}\n"
    )
    with caplog.at_level(logging.INFO, logger="kiln"):
        config = EngineArgs(recipe=str(path)).create_engine_config()
    assert config.speculative == SpeculativeConfig("ngram", 3, 4, 1)
    assert "sets speculative=ngram, lookup 1-4, 3 tokens, measured (was off)" in caplog.text
    assert config.graph.capture_sizes == (1, 2, 8)  # the recipe's sizes are kept as given, never extended
    with caplog.at_level(logging.INFO, logger="kiln"):
        flags = EngineArgs(recipe=str(path), speculative_method="ngram", num_speculative_tokens=6)
        assert flags.create_engine_config().speculative.num_speculative_tokens == 6
    assert (
        "Speculative decoding flags (ngram, lookup 2-4, 6 tokens, measured) override the recipe's (ngram, lookup 1-4, 3"
        in caplog.text
    )
    assert EngineArgs().create_engine_config().speculative == SpeculativeConfig()  # off without either
    path.write_text(path.read_text().replace("prompt_lookup_min: 1", "prompt_lookup_min: 5"))
    line = next(i for i, t in enumerate(path.read_text().splitlines(), 1) if t.startswith("speculative:"))
    with pytest.raises(RecipeError, match=rf"{path}:{line}:\d+: .*prompt_lookup_min 5 is above prompt_lookup_max 4"):
        EngineArgs(recipe=str(path)).create_engine_config()
    base = path.read_text()
    for section, problem in [
        ("method: ngram, draft_model: x", "only used by the draft method, not by ngram"),
        ("method: draft", "the draft method needs a draft model"),
    ]:
        path.write_text(base.replace("method: ngram", section).replace("prompt_lookup_min: 5", "prompt_lookup_min: 1"))
        with pytest.raises(RecipeError, match=rf"{path}:{line}:\d+: .*{problem}"):
            EngineArgs(recipe=str(path)).create_engine_config()
    drafted = base.replace("method: ngram", "method: draft, draft_model: default")
    path.write_text(drafted.replace(", prompt_lookup_min: 5", ""))
    config = EngineArgs(recipe=str(path)).create_engine_config()
    assert config.speculative == SpeculativeConfig("draft", 3, 4, 2, draft_model="default")
    path.write_text(drafted.replace("min: 5", "min: 1"))  # the lookup tunes the ngram method only
    with pytest.raises(RecipeError, match=rf"{path}:{line}:\d+: .*prompt_lookup_min tunes the ngram method only"):
        EngineArgs(recipe=str(path)).create_engine_config()


def test_the_recipes_kv_cache_prefix_caching_false_turns_prefix_caching_off(tmp_path: Path) -> None:
    """The README's `kv_cache.prefix_caching: false`: the engine config the recipe makes has caching off (the engine
    then keeps no prefix cache: tests/engine/test_prefix_caching.py); without the field, caching stays on."""
    on = EngineArgs(recipe=write(tmp_path)).create_engine_config()
    assert on.cache.enable_prefix_caching
    path = Path(write(tmp_path))
    path.write_text(path.read_text().replace("max_pages: 64}", "max_pages: 64, prefix_caching: false}"))
    assert "prefix_caching: false" in path.read_text()
    off = EngineArgs(recipe=str(path)).create_engine_config()
    assert not off.cache.enable_prefix_caching
