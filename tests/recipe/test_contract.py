"""Every field acts or is refused: refused fields are errors at their line; the device and its ISA are checked
against the machine; model.name and model.architecture against the checkpoint; Z3 has one budget per validation."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from kiln.recipe import load_recipe
from kiln.recipe.contract import check_hardware
from kiln.recipe.machine import Machine, this_machine
from kiln.recipe.schema import RecipeSpec
from kiln.recipe.sections import check_kv_dtype
from kiln.recipe.source import parse_source
from tests.compile.tiny import tiny_config

BOUNDS = "input_constraints: {constraints: [num_tokens <= 2048, seq_len <= 2048]}\n"


@pytest.mark.parametrize(
    ("line", "col", "start"),
    [
        (
            "quantization: {weights: int4, group_size: 64}",
            43,
            "quantization.group_size 64 is not what runs: the file's q4_1 blocks stay packed in their own groups of 32",
        ),
        ("quantization: {weights: int8, group_size: 3}", 43, "quantization.group_size 3 is odd: kiln stores 4-bit"),
        ("quantization: {group_size: 64}", 28, "quantization.group_size does nothing without quantized weights"),
        ("quantization: {activations: int8}", 29, "quantization.activations does nothing without quantized"),
        ("memory_plan: {kv_cache: {layout: contiguous}}", 34, "memory_plan.kv_cache.layout: contiguous is not"),
        (
            "memory_plan: {kv_cache: {dtype: fp8_e5m2}}",
            33,
            "memory_plan.kv_cache.dtype: fp8_e5m2 is not supported: kiln stores an fp8 KV cache as e4m3 codes",
        ),
        ("memory_plan: {kv_cache: {dtype: fp8}}", 33, "memory_plan.kv_cache.dtype: fp8 is not supported"),
        (
            "memory_plan: {activation_reuse: false}",
            33,
            "memory_plan.activation_reuse: false is not supported: captured pieces always share static buffers",
        ),
        (
            "debug: {debug_mode: true}\ngraph: {mode: eager}",
            21,
            "debug.debug_mode traces graph-mode pieces, but graph.mode is eager",
        ),
        (
            "input_constraints: {input_ids: {shape: [num_tokens], dtype: int32}, constraints: [num_tokens <= 2048, "
            "seq_len <= 2048]}",
            61,
            "input_constraints.input_ids.dtype: int32 is not supported: kiln feeds input_ids",
        ),
    ],
)
def test_refused_field_is_an_error_at_its_line(header, write, only_error, line, col, start) -> None:
    bounds = "" if line.startswith("input_constraints") else BOUNDS
    err = only_error(write(header + bounds + line + "\n"))
    assert (err.line, err.col) == (4 + bool(bounds), col)
    assert err.message.startswith(start), err.message


def test_missing_device_is_an_error_citing_the_line(header, write, only_error) -> None:
    err = only_error(write(header + BOUNDS + "hardware: {memory_budget_gb: 4}\n"))
    assert (err.line, err.col, err.message) == (5, 1, "missing required key 'device' in hardware")


def test_cuda_on_a_machine_without_one(header, write, only_error) -> None:
    if this_machine().cuda is not None:  # a GPU machine runs cuda recipes: the check is the other branch
        assert load_recipe(write(header + BOUNDS + "hardware: {device: cuda}\n")).device == "cuda"
        return
    err = only_error(write(header + BOUNDS + "hardware: {device: cuda}\n"))
    assert (err.line, err.col) == (5, 20)
    assert err.message.startswith("kiln runs on CPU here (no CUDA device is visible: ")
    assert err.message.endswith("this recipe asks for cuda")


def test_vague_arch_is_refused(header, write, only_error) -> None:
    err = only_error(write(header + BOUNDS + "hardware: {device: cpu, arch: modern}\n"))
    assert (err.line, err.col) == (5, 31)
    assert err.message.startswith("hardware.arch 'modern' is not an architecture kiln can check: use a CPU ISA (")


def test_arch_this_machine_lacks_is_an_error(header, write, only_error) -> None:
    machine = this_machine()
    missing = "aarch64" if machine.machine == "x86_64" else "x86_64"
    err = only_error(write(header + BOUNDS + f"hardware: {{device: cpu, arch: {missing}}}\n"))
    assert (err.line, err.col) == (5, 31)
    assert err.message == f"hardware.arch {missing}: this CPU does not have it: {machine.cpu_summary()}"
    assert (
        load_recipe(write(header + BOUNDS + f"hardware: {{device: cpu, arch: {machine.machine}}}\n")).diagnostics == []
    )


X86 = Machine("x86_64", frozenset({"avx2", "avx512f", "avx512_bf16"}), "Test CPU", None)
H100 = Machine("x86_64", frozenset({"avx2"}), "Test CPU", (9, 0), "H100")
A100 = Machine("x86_64", frozenset({"avx2"}), "Test CPU", (8, 0), "A100")


@pytest.mark.parametrize(
    ("machine", "hardware", "expected"),
    [
        (X86, "{device: cpu, arch: avx512}", None),
        (X86, "{device: cpu, arch: avx512_bf16}", None),
        (
            X86,
            "{device: cpu, arch: amx}",
            "hardware.arch amx: this CPU does not have it: Test CPU (x86_64, avx2, avx512, avx512_bf16)",
        ),
        (X86, "{device: cpu, arch: sm_80}", "hardware.arch sm_80 is a CUDA architecture but hardware.device is cpu"),
        (H100, "{device: cuda, arch: sm_80}", None),
        (H100, "{device: cuda, arch: sm_90a}", None),
        (
            A100,
            "{device: cuda, arch: sm_90}",
            "hardware.arch sm_90: the CUDA device here is A100 (sm_80), older than sm_90",
        ),
        (H100, "{device: cuda, arch: avx2}", "hardware.arch avx2 is a CPU ISA but hardware.device is cuda; use sm_XX"),
        (
            X86,
            "{device: cuda}",
            "kiln runs on CPU here (no CUDA device is visible: Test CPU (x86_64, avx2, avx512, "
            "avx512_bf16)); this recipe asks for cuda",
        ),
    ],
)
def test_hardware_against_a_machine(machine, hardware, expected) -> None:
    doc = parse_source(f"recipe_version: 1\nmodel: {{name: m}}\nhardware: {hardware}\n", "r.yaml")
    found = check_hardware(doc, RecipeSpec.model_validate(doc.data), machine)
    assert [d.message for d in found] == ([expected] if expected else [])
    assert all(d.line == 3 for d in found)


@pytest.mark.parametrize(
    ("model", "why"),
    [
        ("{name: qwen2-7b}", "('qwen2' is not in its name)"),
        ("{name: smollm2-1.7b-instruct}", "(1700M parameters is not its size)"),
    ],
)
def test_model_name_is_checked_against_the_checkpoint(write, only_error, model, why) -> None:
    err = only_error(write(f"recipe_version: 1\nmodel: {model}\nweights: {{source_quantization: q4_1}}\n{BOUNDS}"))
    assert (err.line, err.col) == (2, 15)
    assert err.message.startswith(f"model.name {model[7:-1]!r} does not match the checkpoint {why}: ")
    assert "SmolLM2-135M-Instruct.Q4_1.gguf is 'Smollm2 135M 8k Lc100K Mix1 Ep2' (llama, 134.5M parameters)" in (
        err.message
    )


def test_model_architecture_is_checked(write, only_error) -> None:
    text = "recipe_version: 1\nmodel: {name: SmolLM2-135M, architecture: %s}\nweights: {source_quantization: q4_1}\n"
    err = only_error(write(text % "qwen2" + BOUNDS))
    assert (err.line, err.col) == (2, 43)
    assert err.message.startswith("model.architecture 'qwen2' does not match the checkpoint: ")
    assert load_recipe(write(text % "LlamaForCausalLM" + BOUNDS)).spec.model.architecture == "LlamaForCausalLM"


HARD = """\
input_constraints:
  constraints:
    - num_tokens <= 2048
    - seq_len <= 2048
    - num_tokens * batch_size * seq_len % 7919 == 13
    - num_tokens * seq_len * seq_len % 104729 == 17
    - batch_size * batch_size * num_tokens % 15485863 == 5
"""


def test_solver_budget_covers_the_whole_validation(header, write, only_error) -> None:
    path = write(header + HARD)
    started = time.monotonic()
    err = only_error(path, solver_budget_s=0.2)
    elapsed = time.monotonic() - started
    assert (err.line, err.col) == (5, 3)
    assert err.message.startswith(
        "could not finish proving the constraints: the solver's budget of 0.2 s for this validation ran out"
    )
    assert elapsed < 5  # one budget for every query, not 2 s per query


@pytest.mark.parametrize(("required", "severity"), [("true", "error"), ("false", "warning")])
def test_a_fusion_group_without_generated_code(header, write, diagnostics_of, required, severity) -> None:
    text = (
        header
        + BOUNDS
        + f"graph: {{compiler: eager}}\nfusion_groups: [{{name: mlp, ops: [silu, mul], required: {required}}}]\n"
    )
    path = write(text)
    if severity == "warning":
        (found,) = load_recipe(path).diagnostics
    else:
        (found,) = diagnostics_of(path)
    assert (found.line, found.col, found.severity) == (6, 17, severity)
    assert found.message.startswith("fusion group mlp cannot be realised: graph.compiler is eager, so no code is")


def test_mixture_of_experts_counts_are_checked_against_the_checkpoint(write, only_error, tmp_path) -> None:
    from tests.engine.tiny_models import write_hf_model

    write_hf_model(tmp_path / "moe", "qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    text = "recipe_version: 1\nmodel: {name: moe, path: moe, num_experts: %d, top_k: 2}\n"
    err = only_error(write(text % 8 + BOUNDS))
    assert (err.line, err.col) == (2, 44)
    assert err.message.startswith("model.num_experts is 8, but the checkpoint has 4 (")
    bounds = "input_constraints: {constraints: [num_tokens <= 2048, seq_len <= 2048, top_k < num_experts]}\n"
    recipe = load_recipe(write(text % 4 + bounds))
    assert (recipe.spec.model.num_experts, recipe.spec.model.top_k) == (4, 2)
    dense = "recipe_version: 1\nmodel: {name: SmolLM2-135M, top_k: 2}\nweights: {source_quantization: q4_1}\n"
    assert only_error(write(dense + BOUNDS)).message.startswith("model.top_k is 2, but the checkpoint has no mixture")


def test_scaled_kv_dtypes_need_a_head_dim_that_holds_the_scale_aligned() -> None:
    """int8 and fp8_e4m3 rows end in a float32 scale (kiln.model.kv_format): a head dim that is not a multiple of 4
    is refused at the dtype's line; the float dtypes run any head dim."""
    odd = replace(tiny_config(), head_dim=6)
    for dtype, refused in [("int8", True), ("fp8_e4m3", True), ("bfloat16", False), ("auto", False)]:
        head = "recipe_version: 1\nmodel: {name: m}\nhardware: {device: cpu}\n"
        text = head + f"memory_plan: {{kv_cache: {{dtype: {dtype}}}}}\n"
        doc = parse_source(text, "r.yaml")
        found = check_kv_dtype(doc, RecipeSpec.model_validate(doc.data), odd)
        assert [(d.line, d.message.split(":")[0]) for d in found] == (
            [(4, "memory_plan.kv_cache.dtype")] if refused else []
        )
        assert check_kv_dtype(doc, RecipeSpec.model_validate(doc.data), tiny_config()) == []  # head dim 16


@pytest.mark.parametrize(
    ("line", "key", "start"),
    [
        (
            "debug: {debug_mode: true}\ngraph: {mode: eager}",
            "debug_mode",
            "debug.debug_mode traces graph-mode pieces, but graph.mode is eager",
        ),
        ("graph: {mode: eager, compiler: eager}", "compiler", "graph.compiler does nothing under graph.mode eager"),
        ("graph: {mode: eager, capture_sizes: [4, 8]}", "capture_sizes", "graph.capture_sizes does nothing under"),
        (
            "speculative: {num_speculative_tokens: 2}",
            "num_speculative_tokens",
            "speculative.num_speculative_tokens does nothing without speculative.method",
        ),
        ("speculative: {policy: always}", "policy", "speculative.policy does nothing without speculative.method"),
        (
            "speculative: {method: draft, draft_model: default, prompt_lookup_min: 1}",
            "prompt_lookup_min",
            "speculative.prompt_lookup_min tunes the ngram method only, not draft",
        ),
    ],
)
def test_a_field_that_would_do_nothing_is_an_error_at_its_line(header, write, only_error, line, key, start) -> None:
    err = only_error(write(header + BOUNDS + line + "\n"))
    assert err.message.startswith(start), err.message
    assert (err.line, err.col) == (5, line.index(key) + len(key) + 3)  # at the field's value


def test_the_same_fields_act_where_they_apply(header, write) -> None:
    recipe = load_recipe(write(header + BOUNDS + "speculative: {method: ngram, num_speculative_tokens: 2}\n"))
    assert recipe.spec.speculative.num_speculative_tokens == 2
    recipe = load_recipe(write(header + BOUNDS + "graph: {mode: piecewise, compiler: eager}\n"))
    assert recipe.spec.graph.compiler == "eager"
