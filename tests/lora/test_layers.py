"""Each adapted layer adds exactly its adapter's product to its base's output, whatever the base's form (plain or
quantized at load): fused qkv_proj and gate_up_proj take each part's B on that part's rows only, per token slot."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.errors import ConfigError
from kiln.lora import BASE_ONLY, LoRAAdapter, LoRALimits, LoRASlots, attach_lora, read_adapter
from kiln.lora.forms import FORMS, GATHERED, STACKED
from kiln.lora.layer import GATHERED_MAX_ROWS, LoRALinear
from kiln.model.build import build_model
from kiln.model.loader.hf_loader import HFCheckpoint
from kiln.quant.linear import PackedLinear
from tests.lora.adapters import MAX_POSITIONS

# kiln module of layer 0 -> the HF layers stacked in it, in row order
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.down_proj": ("mlp.down_proj",),
}


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_each_part_adds_its_own_product(quantization: str, lora_dir: Path, adapters: dict[str, Path]) -> None:
    model = build_model(HFCheckpoint(str(lora_dir / "base")), torch.float32, MAX_POSITIONS, quantization=quantization)
    # float32 buffers asked for: auto would be bfloat16 over the int8 base (test_lora_dtype_...)
    slots = attach_lora(model, LoRALimits(max_loras=3, max_rank=8, max_num_tokens=16, dtype="float32"))
    first, second = read_adapter(adapters["all7-r4"]), read_adapter(adapters["kod-r2"])
    slots.load(2, first)
    slots.load(0, second)
    x = torch.randn(4, 96)
    slots.set_token_slots([2, BASE_ONLY, 1, 0])  # slot 1 is empty: the base alone
    for module, parts in FUSED.items():
        layer = model.get_submodule(f"model.layers.0.{module}")
        assert isinstance(layer, LoRALinear)
        assert isinstance(layer.base, PackedLinear) == (quantization == "int8")
        inputs = x[:, : layer.in_features]
        with torch.inference_mode():
            delta = layer(inputs) - layer.base(inputs)
        for row, adapter in ((0, first), (3, second)):
            want = torch.cat([_product(adapter, slots, f"model.layers.0.{p}", inputs[row]) for p in parts])
            torch.testing.assert_close(delta[row], want, rtol=0, atol=1e-5)
        assert not delta[1:3].any()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_forms_compute_the_same_products(dtype: str, lora_dir: Path, adapters: dict[str, Path]) -> None:
    """The stacked form (every slot, masked) and the gathered one (each token's slot only) over the same buffers, in
    either buffer dtype: the same product per token, nothing for BASE_ONLY tokens and empty slots."""
    model = build_model(HFCheckpoint(str(lora_dir / "base")), torch.float32, MAX_POSITIONS)
    slots = attach_lora(model, LoRALimits(max_loras=3, max_rank=8, max_num_tokens=16, dtype=dtype))
    slots.load(0, read_adapter(adapters["all7-r4"]))
    slots.load(2, read_adapter(adapters["gate-up-patterns"]))
    slots.set_token_slots([2, BASE_ONLY, 0, 1, 0])
    x = torch.randn(5, 96)
    tolerance = 1e-5 if dtype == "float32" else 2e-2  # bf16 stacked GEMMs round x too
    for module in FUSED:
        layer = model.get_submodule(f"model.layers.0.{module}")
        assert layer.lora_a.dtype == getattr(torch, dtype)
        inputs = x[:, : layer.in_features]
        stacked, gathered = (FORMS[name].delta(layer, inputs) for name in (STACKED, GATHERED))
        assert stacked.dtype == gathered.dtype == torch.float32
        torch.testing.assert_close(gathered, stacked, rtol=0, atol=tolerance * max(1.0, float(stacked.abs().max())))
        assert not gathered[[1, 3]].any() and not stacked[[1, 3]].any()
        assert gathered[2].any()  # all7-r4 adapts every layer, gate-up-patterns gate and up only
        assert bool(gathered[0].any()) == (module == "mlp.gate_up_proj")


def test_a_step_runs_the_form_of_its_rows(lora_dir: Path) -> None:
    model = build_model(HFCheckpoint(str(lora_dir / "base")), torch.float32, MAX_POSITIONS)
    attach_lora(model, LoRALimits(max_loras=2, max_rank=4, max_num_tokens=128))
    layer = model.get_submodule("model.layers.0.mlp.down_proj")
    assert layer.form_for(1).name == layer.form_for(GATHERED_MAX_ROWS).name == GATHERED
    assert layer.form_for(GATHERED_MAX_ROWS + 1).name == STACKED


def test_lora_dtype_is_checked_and_auto_keeps_the_models_over_float_weights(lora_dir: Path) -> None:
    with pytest.raises(ConfigError, match="LoRA dtype 'float16'"):
        LoRALimits(dtype="float16")
    assert LoRALimits().buffer_dtype(torch.float32) is torch.float32
    assert LoRALimits().buffer_dtype(torch.float32, packed=True) is torch.bfloat16
    assert LoRALimits(dtype="bfloat16").buffer_dtype(torch.float32) is torch.bfloat16
    assert LoRALimits(dtype="float32").buffer_dtype(torch.float32, packed=True) is torch.float32
    for quantization, dtype in (("none", torch.float32), ("int8", torch.bfloat16)):
        model = build_model(
            HFCheckpoint(str(lora_dir / "base")), torch.float32, MAX_POSITIONS, quantization=quantization
        )
        slots = attach_lora(model, LoRALimits(max_loras=1, max_rank=4, max_num_tokens=8))
        assert {(layer.lora_a.dtype, layer.lora_b.dtype) for layer in slots.layers.values()} == {(dtype, dtype)}


def _product(adapter: LoRAAdapter, slots: LoRASlots, module: str, x: torch.Tensor) -> torch.Tensor:
    """The adapter's output for HF layer `module` (zeros where the adapter leaves it out)."""
    lora = adapter.layers.get(module)
    if lora is None:
        return torch.zeros(slots.targets[module].rows)
    return lora.b @ (lora.a @ x) * lora.scale
