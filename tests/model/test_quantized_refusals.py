"""Every refusal of a quantized HF checkpoint has its message: a quantization_config kiln does not read (its
method, format settings, sparsity or rotations), a `--quantization` or recipe that contradicts it, and
`--quantization packed` over float weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kiln import LLM
from kiln.errors import ConfigError, ModelLoadError
from kiln.model.loader import open_checkpoint
from kiln.recipe import RecipeError, load_recipe
from tests.engine.tiny_models import rewrite_config, write_hf_model
from tests.model.quantized_models import edit_quantization_config, write_compressed_model, write_gptq_awq_model


@pytest.fixture(scope="module")
def w4a16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("w4a16")
    write_compressed_model(directory, "W4A16")
    return directory


@pytest.fixture(scope="module")
def gptq(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("gptq")
    write_gptq_awq_model(directory, "gptq")
    return directory


def copy_of(directory: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(directory, tmp_path / directory.name))


def load_error(directory: Path) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as info:
        open_checkpoint(str(directory))
    return info.value


def test_an_unknown_quant_method_names_the_field_and_the_methods_kiln_reads(tmp_path: Path) -> None:
    write_hf_model(tmp_path, "llama")
    config = rewrite_config(tmp_path, {"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}})
    err = load_error(tmp_path)
    assert err.path == str(config)
    assert err.problem == (
        "field quantization_config.quant_method is 'bitsandbytes': kiln reads compressed-tensors, gptq, awq "
        "checkpoints (for another one, load its float weights, optionally with --quantization int8|int4)"
    )
    rewrite_config(tmp_path, {"quantization_config": "int4"})
    assert load_error(tmp_path).problem == "field quantization_config must be an object, found 'int4'"


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"sparsity_config": {"format": "sparse-24-bitmask"}}, "field quantization_config.sparsity_config is set"),
        ({"transform_config": {"config_groups": {}}}, "field quantization_config.transform_config is set"),
        ({"config_groups": "W4A16"}, "field quantization_config.config_groups Input should be a valid dictionary"),
    ],
)
def test_compressed_tensors_settings_kiln_cannot_honour_are_refused(
    w4a16: Path, tmp_path: Path, changes: dict, problem: str
) -> None:
    directory = copy_of(w4a16, tmp_path)
    edit_quantization_config(directory, **changes)
    assert load_error(directory).problem.startswith(problem)


def test_a_stored_quantized_layer_no_config_group_targets_is_refused(w4a16: Path, tmp_path: Path) -> None:
    directory = copy_of(w4a16, tmp_path)
    config = json.loads((directory / "config.json").read_text())["quantization_config"]
    config["config_groups"]["group_0"]["targets"] = ["re:.*q_proj$"]
    edit_quantization_config(directory, config_groups=config["config_groups"])
    with pytest.raises(ModelLoadError) as info:
        open_checkpoint(str(directory)).weight_shapes()
    assert info.value.problem.startswith("field quantization_config.config_groups has no scheme for the stored ")


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"bits": 3}, "field quantization_config.bits is 3: kiln reads 4, 8"),
        ({"checkpoint_format": "marlin"}, "field quantization_config.checkpoint_format is 'marlin': kiln reads gptq"),
        ({"group_size": "32"}, "field quantization_config.group_size must be a positive integer or -1 (one group)"),
    ],
)
def test_gptq_settings_kiln_does_not_read_are_refused(gptq: Path, tmp_path: Path, changes: dict, problem: str) -> None:
    directory = copy_of(gptq, tmp_path)
    edit_quantization_config(directory, **changes)
    assert load_error(directory).problem.startswith(problem)


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"version": "gemv"}, "field quantization_config.version is 'gemv': kiln reads AWQ's gemm layout"),
        ({"zero_point": False}, "field quantization_config.zero_point is false: kiln reads AWQ checkpoints with zero"),
        ({"bits": 8}, "field quantization_config.bits is 8: kiln reads 4"),
    ],
)
def test_awq_settings_kiln_does_not_read_are_refused(gptq: Path, tmp_path: Path, changes: dict, problem: str) -> None:
    directory = copy_of(gptq, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    rewrite_config(directory, {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 32} | changes})
    assert json.loads((directory / "config.json").read_text())["architectures"] == config["architectures"]
    assert load_error(directory).problem.startswith(problem)


def test_a_quantization_flag_that_contradicts_the_checkpoint_is_refused(w4a16: Path) -> None:
    with pytest.raises(ConfigError) as info:
        LLM(str(w4a16), num_kv_blocks=16, graph_mode="eager", quantization="int8")
    assert str(info.value) == (
        f"--quantization int8 contradicts {w4a16}: its config.json quantization_config says it holds "
        "compressed-tensors pack-quantized int4 (group 32, symmetric) weights; use --quantization auto (or int4) to "
        "run them as stored, or none to dequantize them"
    )


def test_packed_over_float_weights_is_refused(tmp_path: Path) -> None:
    write_hf_model(tmp_path, "llama")
    with pytest.raises(ConfigError) as info:
        LLM(str(tmp_path), num_kv_blocks=16, graph_mode="eager", quantization="packed")
    assert str(info.value).startswith(
        f"--quantization packed keeps a quantized checkpoint's weights packed; {tmp_path} holds float weights (no "
        "quantization_config in its config.json"
    )


def recipe_error(directory: Path, tmp_path: Path, weights: str) -> str:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"recipe_version: 1\nmodel: {{name: {directory.name}, path: {directory}}}\n{weights}\n"
        "hardware: {device: cpu}\ninput_constraints: {constraints: [num_tokens <= 512, seq_len <= 512]}\n"
    )
    with pytest.raises(RecipeError) as info:
        load_recipe(str(recipe))
    (error,) = [d for d in info.value.diagnostics if d.severity == "error"]
    return error.format()


def test_a_recipe_that_contradicts_the_quantization_config_is_refused_at_its_line(w4a16: Path, tmp_path: Path) -> None:
    text = recipe_error(
        w4a16, tmp_path, "weights: {dtype: float32, source_quantization: int4}\nquantization: {weights: int8}"
    )
    assert text.startswith(
        f"{tmp_path / 'recipe.yaml'}:4:25: error: quantization.weights: int8 contradicts "
        "weights.source_quantization: int4 (what the checkpoint's quantization_config says it holds)"
    )
    text = recipe_error(w4a16, tmp_path, "weights: {dtype: float32, source_quantization: int8}")
    assert ":3:48: error: weights.source_quantization: int8, but " in text
    assert text.split("\n")[0].endswith("holds INT4 (14 tensors), F32 (7 tensors); set it to int4")


def test_a_recipe_that_agrees_runs_the_codes_packed(w4a16: Path, tmp_path: Path) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"recipe_version: 1\nmodel: {{name: {w4a16.name}, path: {w4a16}}}\n"
        "weights: {dtype: float32, source_quantization: int4}\nquantization: {weights: int4}\n"
        "hardware: {device: cpu}\ninput_constraints: {constraints: [num_tokens <= 512, seq_len <= 512]}\n"
    )
    assert load_recipe(str(recipe)).quantization == "packed"


def test_fused_parts_whose_act_orders_differ_are_refused(tmp_path: Path) -> None:
    write_gptq_awq_model(tmp_path, "gptq", act_order=True, shared_order=False)
    with pytest.raises(ModelLoadError) as info:
        LLM(str(tmp_path), num_kv_blocks=16, graph_mode="eager")
    tensor, _, problem = info.value.problem.partition(": ")
    assert tensor.startswith("tensor model.layers.0.") and tensor.endswith(("k_proj.weight", "up_proj.weight"))
    assert problem == (
        "its input columns are act-ordered (g_idx) unlike the other parts of the fused layer it loads into; load "
        "the checkpoint with --quantization none"
    )
    assert len(LLM(str(tmp_path), num_kv_blocks=16, graph_mode="eager", quantization="none").engine.model.model.layers)
