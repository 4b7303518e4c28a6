"""Checks against the checkpoint header: stored dtypes, model symbols, module names, input shapes, group size."""

from __future__ import annotations

from kiln.recipe import load_recipe

BOUNDS = "input_constraints: {constraints: [num_tokens <= 2048, seq_len <= 2048]}\n"
MODEL = "recipe_version: 1\nmodel: {name: smollm2, path: default}\n"


def test_float16_claim_on_a_q4_1_file_lists_what_it_holds(write, only_error) -> None:
    err = only_error(write(MODEL + "weights: {dtype: float16}\n" + BOUNDS))
    assert (err.line, err.col) == (3, 18)
    assert err.message == (
        "weights.dtype: float16 claims the checkpoint holds float16 weights, but SmolLM2-135M-Instruct.Q4_1.gguf "
        "holds Q4_1 (210 tensors), F32 (61 tensors), Q8_0 (1 tensor); set weights.source_quantization: q4_1 "
        "(kiln dequantizes to weights.dtype)"
    )


def test_wrong_source_quantization(write, only_error) -> None:
    err = only_error(write(MODEL + "weights: {dtype: float32, source_quantization: q8_0}\n" + BOUNDS))
    assert (err.line, err.col) == (3, 48)
    assert err.message.startswith("weights.source_quantization: q8_0, but SmolLM2-135M-Instruct.Q4_1.gguf holds Q4_1")
    assert err.message.endswith("; set it to q4_1")


def test_model_symbol_literal_is_compared_with_the_checkpoint(header, write, only_error) -> None:
    path = write(header + "input_constraints:\n  constraints:\n    - seq_len <= 2048\n    - hidden_size == 512\n")
    err = only_error(path)
    assert (err.line, err.col, err.length) == (7, 7, 18)
    assert (
        err.message == "hidden_size == 512 is false for this model: hidden_size=576 in SmolLM2-135M-Instruct.Q4_1.gguf"
    )


def test_true_model_facts_are_accepted_without_warnings(header, write) -> None:
    path = write(header + BOUNDS.replace("]}", ", num_heads * head_dim == hidden_size, num_kv_heads == 3]}"))
    assert load_recipe(path).diagnostics == []


def test_fusion_op_missing_from_the_model(header, write, only_error) -> None:
    path = write(header + BOUNDS + "fusion_groups:\n  - {name: mlp, ops: [gate_proj, up_projj, silu]}\n")
    err = only_error(path)
    assert (err.line, err.col) == (6, 34)
    assert err.message.startswith("fusion group mlp: op 'up_projj' is not in the model; did you mean 'up_proj'?")


def test_fusion_group_cannot_hold_the_splitting_op(header, write, only_error) -> None:
    path = write(header + BOUNDS + "fusion_groups:\n  - {name: g, ops: [o_proj, kiln.attention]}\n")
    err = only_error(path)
    assert (err.line, err.col) == (6, 29)
    assert err.message == "fusion group g: 'kiln.attention' is where graph pieces split; it cannot be fused"


def test_op_in_two_fusion_groups(header, write, only_error) -> None:
    path = write(
        header + BOUNDS + "fusion_groups:\n  - {name: a, ops: [gate_proj, silu]}\n"
        "  - {name: b, ops: [gate_proj, mul]}\n"
    )
    err = only_error(path)
    assert (err.line, err.col, err.message) == (7, 21, "fusion group b: op 'gate_proj' is already in fusion group a")


def test_input_shape_against_the_model(header, write, diagnostics_of) -> None:
    path = write(
        header + "input_constraints:\n  hidden_states: {shape: [num_tokens, 512], dtype: float16}\n"
        "  input_ids: {shape: [num_tokns], dtype: int64}\n  constraints: [num_tokens <= 64, seq_len <= 64]\n"
    )
    found = {(d.line, d.col, d.message) for d in diagnostics_of(path)}
    assert found == {
        (5, 39, "hidden_states.shape[1]: found 512 but the model's hidden_size is 576"),
        (5, 52, "hidden_states.dtype is float16, expected float32 (the model runs in weights.dtype float32)"),
        (6, 23, "input_ids.shape[0]: unknown symbol 'num_tokns'; did you mean 'num_tokens'?"),
    }


def test_group_size_must_divide_the_layer_inputs(header, write, diagnostics_of) -> None:
    found = diagnostics_of(write(header + "quantization: {weights: int8, group_size: 128}\n" + BOUNDS))
    (err,) = [d for d in found if d.severity == "error"]  # int8 over Q4_1 quantizes at load: any even group size
    assert (err.line, err.col) == (4, 43)
    assert err.message == (
        "quantization.group_size 128 does not divide hidden_size 576 (576 % 128 = 64) or "
        "num_heads * head_dim 576 (576 % 128 = 64); pick a divisor such as 32"
    )


def test_missing_checkpoint_is_reported_at_model_path(write, only_error) -> None:
    err = only_error(write("recipe_version: 1\nmodel: {name: m, path: ./nowhere.gguf}\n" + BOUNDS))
    assert (err.line, err.col) == (2, 24)
    assert err.message.startswith("model.path: cannot read the checkpoint: ")
    assert "nowhere.gguf: no such file or directory" in err.message


def test_model_override(header, write, only_error, tmp_path) -> None:
    err = only_error(write(header + BOUNDS), model=str(tmp_path / "absent"))
    assert err.message.startswith("--model: cannot read the checkpoint: ")
