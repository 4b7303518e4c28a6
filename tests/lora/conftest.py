"""The tiny base model and its PEFT adapters, written once per test module (HF + PEFT built in the test, nothing
downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from tests.engine.tiny_models import default_tokenizer_json
from tests.lora.adapters import SEVEN, write_adapter, write_base

# name -> (targets, rank, extra LoraConfig fields): several ranks, target subsets, alphas and rsLoRA
ADAPTERS: dict[str, tuple[list[str], int, dict[str, object]]] = {
    "all7-r4": (SEVEN, 4, {}),
    "qv-r8-rslora": (["q_proj", "v_proj"], 8, {"use_rslora": True, "lora_alpha": 4}),
    "kod-r2": (["k_proj", "o_proj", "down_proj"], 2, {"lora_alpha": 16}),
    "gate-up-patterns": (
        ["gate_proj", "up_proj"],
        4,
        {"rank_pattern": {"up_proj": 6}, "alpha_pattern": {"gate_proj": 3}},
    ),
}


@pytest.fixture(scope="package")
def lora_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lora")


@pytest.fixture(scope="package")
def hf_base(lora_dir: Path) -> transformers.LlamaForCausalLM:
    return write_base(lora_dir / "base", num_layers=4)  # > 3 layers: graph mode stamps layers 3+ from a template


@pytest.fixture(scope="package")
def adapters(hf_base: transformers.LlamaForCausalLM, lora_dir: Path) -> dict[str, Path]:
    return {
        name: write_adapter(hf_base, lora_dir / name, targets, rank, seed=i, **extra)
        for i, (name, (targets, rank, extra)) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="package")
def base_dir(lora_dir: Path, hf_base: transformers.LlamaForCausalLM) -> Path:
    """The tiny base with a tokenizer (an engine loads one; prompts are token ids here)."""
    base = lora_dir / "base"
    (base / "tokenizer.json").write_text(default_tokenizer_json())
    (base / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": None}))
    return base
