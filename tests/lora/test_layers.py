"""Each adapted layer adds exactly its adapter's product to its base's output, whatever the base's form (plain or
quantized at load): fused qkv_proj and gate_up_proj take each part's B on that part's rows only, per token slot."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.lora import BASE_ONLY, LoRAAdapter, LoRALimits, LoRASlots, attach_lora, read_adapter
from kiln.lora.layer import LoRALinear
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
    slots = attach_lora(model, LoRALimits(max_loras=3, max_rank=8, max_num_tokens=16))
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


def _product(adapter: LoRAAdapter, slots: LoRASlots, module: str, x: torch.Tensor) -> torch.Tensor:
    """The adapter's output for HF layer `module` (zeros where the adapter leaves it out)."""
    lora = adapter.layers.get(module)
    if lora is None:
        return torch.zeros(slots.targets[module].rows)
    return lora.b @ (lora.a @ x) * lora.scale
