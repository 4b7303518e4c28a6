"""The recipe's `lora` section: checked against the schema, the checkpoint, the placement, the memory budget and the
solver's batch bound; overlaid onto the engine config (a contradicting flag refused); the hash of a recipe without
it unchanged."""

from __future__ import annotations

import pytest

from kiln.config import EngineConfig, LoRAConfig
from kiln.engine.setup.recipe_config import overlay_recipe
from kiln.errors import ConfigError
from kiln.recipe import load_recipe

BOUNDS = "input_constraints: {constraints: [num_tokens <= 2048, seq_len <= 2048]}\n"


def test_a_lora_section_turns_adapters_on_with_its_sizes(header, write) -> None:
    lora = "lora: {max_loras: 2, max_rank: 8, target_modules: [q_proj, v_proj]}\n"
    recipe = load_recipe(write(header + BOUNDS + lora))
    assert recipe.lora == LoRAConfig(enabled=True, max_loras=2, max_lora_rank=8, target_modules=("q_proj", "v_proj"))
    given = EngineConfig(lora=LoRAConfig(max_cpu_loras=5, modules=(("a", "/x"),)))
    resolved = overlay_recipe(given, recipe).lora
    assert (resolved.enabled, resolved.max_loras, resolved.max_lora_rank) == (True, 2, 8)
    assert resolved.target_modules == ("q_proj", "v_proj")
    assert (resolved.max_cpu_loras, resolved.modules) == (5, (("a", "/x"),))  # the flags' own
    assert load_recipe(write(header + BOUNDS)).lora is None


def test_a_flag_that_contradicts_the_lora_section_is_refused(header, write) -> None:
    recipe = load_recipe(write(header + BOUNDS + "lora: {max_loras: 2}\n"))
    with pytest.raises(ConfigError) as info:
        overlay_recipe(EngineConfig(lora=LoRAConfig(enabled=True, max_loras=4, max_lora_rank=32)), recipe)
    message = str(info.value)
    assert "--max-loras 4 (the recipe's lora.max_loras is 2)" in message
    assert "--max-lora-rank 32 (the recipe's lora.max_rank is 16)" in message
    assert "--enable-lora" not in message  # the section turns adapters on: the flag agrees
    kept = overlay_recipe(EngineConfig(lora=LoRAConfig(enabled=True, max_loras=2)), recipe).lora
    assert (kept.enabled, kept.max_loras) == (True, 2)


def test_the_section_sets_the_buffers_dtype_and_a_contradicting_flag_is_refused(header, write) -> None:
    recipe = load_recipe(write(header + BOUNDS + "lora: {max_loras: 2, dtype: bfloat16}\n"))
    assert recipe.lora is not None and recipe.lora.dtype == "bfloat16"
    assert overlay_recipe(EngineConfig(), recipe).lora.dtype == "bfloat16"
    with pytest.raises(ConfigError, match=r"--lora-dtype float32 \(the recipe's lora.dtype is bfloat16\)"):
        overlay_recipe(EngineConfig(lora=LoRAConfig(enabled=True, max_loras=2, dtype="float32")), recipe)
    assert load_recipe(write(header + BOUNDS + "lora: {}\n")).lora.dtype == "auto"  # type: ignore[union-attr]


def test_without_a_section_the_flags_stay(header, write) -> None:
    recipe = load_recipe(write(header + BOUNDS))
    given = LoRAConfig(enabled=True, max_loras=3, max_lora_rank=64)
    assert overlay_recipe(EngineConfig(lora=given), recipe).lora == given


def test_an_unknown_target_module_is_a_schema_error_at_its_line(header, write, only_error) -> None:
    err = only_error(write(header + BOUNDS + "lora:\n  target_modules: [q_proj, lm_head]\n"))
    assert err.line == 6 and "lm_head" in err.message and "q_proj" in err.message, err.format()


def test_a_target_module_the_checkpoint_lacks_is_refused(header, write, only_error) -> None:
    err = only_error(write(header + BOUNDS + "lora:\n  target_modules: [q_proj, qkv_proj]\n"))
    assert err.line == 6
    assert err.message.startswith("lora.target_modules: qkv_proj is not a layer of the checkpoint (it has ")
    assert "q_proj" in err.message and "down_proj" in err.message


def test_a_repeated_target_module_is_refused(header, write, only_error) -> None:
    err = only_error(write(header + BOUNDS + "lora:\n  target_modules: [q_proj, q_proj]\n"))
    assert err.message == "lora.target_modules lists q_proj twice"


def test_adapters_on_several_devices_are_accepted(header, write) -> None:
    recipe = load_recipe(write(header + BOUNDS + "parallel: {tensor: 2}\nlora: {max_loras: 1}\n"))
    assert recipe.lora is not None and recipe.lora.max_loras == 1  # split as their layers (tests/lora/test_parallel.py)


def test_the_lora_buffers_count_against_the_memory_budget(header, write, only_error) -> None:
    hardware = "hardware: {device: cpu, memory_budget_gb: 2}\n"
    assert load_recipe(write(header + BOUNDS + hardware + "lora: {max_loras: 1, max_rank: 8}\n")).lora is not None
    err = only_error(write(header + BOUNDS + hardware + "lora: {max_loras: 64, max_rank: 512}\n"))
    assert err.message.startswith("memory_budget_gb 2 is too small"), err.message
    assert "the LoRA buffers" in err.message and "(lora.max_loras x lora.max_rank)" in err.message
    # 30 layers x 64 slots x rank 512 x (q 1152 + k 768 + v 768 + o 1152 + gate, up, down 2112 each) x 4 bytes
    assert f"the LoRA buffers {30 * 64 * 512 * 10176 * 4 / 1e9:.2f} GB" in err.message
    half = only_error(write(header + BOUNDS + hardware + "lora: {max_loras: 64, max_rank: 512, dtype: bfloat16}\n"))
    assert f"the LoRA buffers {30 * 64 * 512 * 10176 * 2 / 1e9:.2f} GB" in half.message  # bfloat16: half the bytes


def test_more_slots_than_a_step_holds_warns_with_the_solver_bound(header, write) -> None:
    bounds = "input_constraints: {constraints: [num_tokens <= 2048, seq_len <= 2048, batch_size <= 4]}\n"
    recipe = load_recipe(write(header + bounds + "lora:\n  max_loras: 8\n"))
    warnings = [d for d in recipe.diagnostics if d.message.startswith("lora.max_loras")]
    assert len(warnings) == 1 and warnings[0].severity == "warning" and warnings[0].line == 6
    assert "batch_size can reach 4 (bounded by batch_size <= 4 (line 4))" in warnings[0].message
    recipe = load_recipe(write(header + bounds + "lora:\n  max_loras: 4\n"))
    assert not [d for d in recipe.diagnostics if d.message.startswith("lora.")]


def test_a_rank_above_the_hidden_size_warns(header, write) -> None:
    recipe = load_recipe(write(header + BOUNDS + "lora: {max_rank: 1024}\n"))
    (warning,) = [d for d in recipe.diagnostics if d.message.startswith("lora.max_rank")]
    assert warning.severity == "warning" and "above the model's hidden_size 576" in warning.message


def test_the_hash_changes_with_the_section_only(header, write) -> None:
    plain = load_recipe(write(header + BOUNDS)).hash
    assert load_recipe(write(header + BOUNDS + "# a comment\n")).hash == plain
    with_lora = load_recipe(write(header + BOUNDS + "lora: {max_loras: 2}\n")).hash
    assert with_lora != plain
    assert load_recipe(write(header + BOUNDS + "lora: {max_loras: 3}\n")).hash != with_lora
