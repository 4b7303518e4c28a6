"""Reading PEFT adapters: scales (alpha / rank, rsLoRA, per-layer patterns), and every bad adapter answered with an
AdapterError naming the file and the field, before any buffer changes."""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.errors import AdapterError
from kiln.lora import LoRALimits, attach_lora, read_adapter
from tests.lora.adapters import edit_config, kiln_model, write_adapter

PREFIX = "base_model.model.model.layers.0."


def test_scales_follow_alpha_rslora_and_patterns(adapters: dict[str, Path]) -> None:
    plain = read_adapter(adapters["all7-r4"])
    assert len(plain.layers) == 28 and plain.rank == 4  # 7 targets x 4 layers
    assert plain.layers["model.layers.0.mlp.down_proj"].scale == pytest.approx(8 / 4)
    rslora = read_adapter(adapters["qv-r8-rslora"])
    assert set(rslora.layers) == {f"model.layers.{i}.self_attn.{m}" for i in range(4) for m in ("q_proj", "v_proj")}
    assert rslora.layers["model.layers.1.self_attn.v_proj"].scale == pytest.approx(4 / math.sqrt(8))
    patterns = read_adapter(adapters["gate-up-patterns"])
    up, gate = patterns.layers["model.layers.0.mlp.up_proj"], patterns.layers["model.layers.0.mlp.gate_proj"]
    assert (up.rank, up.scale) == (6, pytest.approx(8 / 6))
    assert (gate.rank, gate.scale) == (4, pytest.approx(3 / 4))


def _copy(adapters: dict[str, Path], name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(adapters[name], tmp_path / name))


def _edit_tensors(adapter: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    path = adapter / "adapter_model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def _load(base: Path, adapter: Path, max_rank: int = 8) -> None:
    model = kiln_model(base)
    attach_lora(model, LoRALimits(max_loras=1, max_rank=max_rank, max_num_tokens=16)).load(0, read_adapter(adapter))


def _rename(tensors: dict[str, torch.Tensor], old: str, new: str) -> None:
    tensors[new] = tensors.pop(old)


# case -> (how the good adapter "all7-r4" is spoiled, the file at fault, the field, words of the message)
BAD: dict[str, tuple[Callable[[Path], None], str, str, str]] = {
    "wrong input shape": (
        lambda a: _edit_tensors(a, lambda t: t.update({PREFIX + "self_attn.q_proj.lora_A.weight": torch.zeros(4, 32)})),
        "adapter_model.safetensors",
        PREFIX + "self_attn.q_proj.lora_A.weight",
        "shape (4, 32): the base layer takes 64 inputs",
    ),
    "wrong output shape": (
        lambda a: _edit_tensors(a, lambda t: t.update({PREFIX + "self_attn.v_proj.lora_B.weight": torch.zeros(64, 4)})),
        "adapter_model.safetensors",
        PREFIX + "self_attn.v_proj.lora_B.weight",
        "shape (64, 4): the base layer gives 32 outputs",
    ),
    "missing tensor": (
        lambda a: _edit_tensors(a, lambda t: t.pop(PREFIX + "mlp.up_proj.lora_B.weight")),
        "adapter_model.safetensors",
        PREFIX + "mlp.up_proj.lora_B.weight",
        "missing (its lora_A is in the file)",
    ),
    "missing weights file": (
        lambda a: (a / "adapter_model.safetensors").unlink(),
        "adapter_model.safetensors",
        "file",
        "missing",
    ),
    "layer the base lacks": (
        lambda a: _edit_tensors(
            a,
            lambda t: [
                _rename(
                    t,
                    f"{PREFIX}mlp.down_proj.lora_{w}.weight",
                    f"base_model.model.model.layers.7.mlp.down_proj.lora_{w}.weight",
                )
                for w in "AB"
            ],
        ),
        "adapter_model.safetensors",
        "base_model.model.model.layers.7.mlp.down_proj.lora_A.weight",
        "the base model has no layer model.layers.7.mlp.down_proj",
    ),
    "unknown target in the tensors": (
        lambda a: _edit_tensors(
            a,
            lambda t: [
                _rename(t, f"{PREFIX}mlp.down_proj.lora_{w}.weight", f"base_model.model.lm_head.lora_{w}.weight")
                for w in "AB"
            ],
        ),
        "adapter_model.safetensors",
        "base_model.model.lm_head.lora_A.weight",
        "unknown target module 'lm_head' (not a decoder linear layer)",
    ),
    "unknown target in the config": (
        lambda a: edit_config(a, target_modules=["q_proj", "embed_tokens"]),
        "adapter_config.json",
        "target_modules",
        "unknown target module 'embed_tokens'",
    ),
    "rank unlike the config's": (
        lambda a: edit_config(a, r=5),
        "adapter_model.safetensors",
        "lora_A.weight",
        "rank 4, but adapter_config.json gives this layer rank 5",
    ),
    "bad pattern": (
        lambda a: edit_config(a, rank_pattern={"up_proj(": 2}),
        "adapter_config.json",
        "rank_pattern['up_proj(']",
        "not a regular expression",
    ),
    "DoRA": (lambda a: edit_config(a, use_dora=True), "adapter_config.json", "use_dora", "DoRA"),
    "trained bias": (lambda a: edit_config(a, bias="all"), "adapter_config.json", "bias", "trained biases"),
    "rank not a number": (lambda a: edit_config(a, r="four"), "adapter_config.json", "r", "expected a positive number"),
    "not LoRA": (lambda a: edit_config(a, peft_type="IA3"), "adapter_config.json", "peft_type", "kiln runs LoRA"),
    "missing config": (
        lambda a: (a / "adapter_config.json").unlink(),
        "adapter_config.json",
        "file",
        "missing",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_adapter_names_file_and_field(case: str, adapters: dict[str, Path], lora_dir: Path, tmp_path: Path) -> None:
    spoil, file, field, words = BAD[case]
    adapter = _copy(adapters, "all7-r4", tmp_path)
    spoil(adapter)
    with pytest.raises(AdapterError) as caught:
        _load(lora_dir / "base", adapter)
    assert caught.value.path == str(adapter / file)
    assert field in caught.value.field and words in str(caught.value)
    assert str(caught.value).startswith(f"{adapter / file}: ")


def test_rank_above_the_limit(adapters: dict[str, Path], lora_dir: Path) -> None:
    with pytest.raises(AdapterError) as caught:
        _load(lora_dir / "base", adapters["qv-r8-rslora"], max_rank=4)
    assert caught.value.path.endswith("adapter_config.json") and caught.value.field == "r"
    assert "rank 8 (layer model.layers.0.self_attn.q_proj) is above the engine's limit, --max-lora-rank 4" in str(
        caught.value
    )


def test_lm_head_adapter_is_refused(hf_base: object, lora_dir: Path, tmp_path: Path) -> None:
    adapter = write_adapter(hf_base, tmp_path / "head", ["q_proj", "lm_head"], 4, seed=9)
    with pytest.raises(AdapterError, match="target_modules: unknown target module 'lm_head'"):
        _load(lora_dir / "base", adapter)


def test_a_bad_adapter_leaves_the_loaded_one(adapters: dict[str, Path], lora_dir: Path, tmp_path: Path) -> None:
    model = kiln_model(lora_dir / "base")
    slots = attach_lora(model, LoRALimits(max_loras=2, max_rank=4, max_num_tokens=16))
    slots.load(0, read_adapter(adapters["all7-r4"]))
    before = {name: (layer.lora_a.clone(), layer.lora_b.clone()) for name, layer in slots.layers.items()}
    with pytest.raises(AdapterError, match="--max-lora-rank 4"):
        slots.load(0, read_adapter(adapters["qv-r8-rslora"]))
    for name, layer in slots.layers.items():
        assert torch.equal(layer.lora_a, before[name][0]) and torch.equal(layer.lora_b, before[name][1])
    assert slots.loaded == {0: str(adapters["all7-r4"])}


def test_a_tensor_of_no_lora_layer_is_refused(adapters: dict[str, Path], lora_dir: Path, tmp_path: Path) -> None:
    adapter = _copy(adapters, "all7-r4", tmp_path)
    _edit_tensors(adapter, lambda t: t.update({"base_model.model.model.norm.weight": torch.ones(64)}))
    with pytest.raises(AdapterError, match=r"model\.norm\.weight: not a LoRA tensor"):
        _load(lora_dir / "base", adapter)
