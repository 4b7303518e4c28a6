"""A recipe's `lora:` section through the engine: it turns adapters on with its sizes, an adapter of a layer outside
`target_modules` is refused naming its file and the module, and a flag that contradicts the section is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln import LLM, LoRARequest, SamplingParams
from kiln.errors import AdapterError, ConfigError

RECIPE = """\
recipe_version: 1
model: {{name: base, path: {base}}}
input_constraints: {{constraints: [num_tokens <= 64, seq_len <= 128, batch_size <= 4]}}
memory_plan: {{kv_cache: {{block_size: 4, max_pages: 64}}}}
graph: {{mode: eager}}
lora: {{max_loras: 2, max_rank: 8, target_modules: [q_proj, v_proj]}}
hardware: {{device: cpu}}
"""


@pytest.fixture(scope="module")
def recipe(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("lora_recipe") / "recipe.yaml"
    path.write_text(RECIPE.format(base=base_dir))
    return path


def test_the_recipe_turns_adapters_on_and_restricts_their_targets(
    base_dir: Path, recipe: Path, adapters: dict[str, Path]
) -> None:
    llm = LLM(str(base_dir), recipe=str(recipe))
    lora = llm.engine.lora
    assert lora is not None and (lora.slots.limits.max_loras, lora.slots.limits.max_rank) == (2, 8)
    params = SamplingParams(max_tokens=3, temperature=0)
    qv = LoRARequest("qv", 1, str(adapters["qv-r8-rslora"]))
    (out,) = llm.generate([[3, 17, 5]], params, lora_request=qv)
    assert len(out.token_ids) == 3
    with pytest.raises(AdapterError) as info:
        llm.generate([[3, 17, 5]], params, lora_request=LoRARequest("all7", 2, str(adapters["all7-r4"])))
    assert str(adapters["all7-r4"] / "adapter_model.safetensors") in str(info.value)
    assert "outside the engine's LoRA target modules (q_proj, v_proj" in str(info.value)


def test_a_flag_that_contradicts_the_recipe_is_refused(base_dir: Path, recipe: Path) -> None:
    with pytest.raises(ConfigError, match=r"--max-loras 4 \(the recipe.s lora.max_loras is 2\)"):
        LLM(str(base_dir), recipe=str(recipe), max_loras=4)
