"""Which of a model's linear layers are packed: with `--quantization packed`, those whose every checkpoint part
(q, k and v of a fused qkv_proj) is stored in a packed GGUF type; with int8/int4, every decoder linear layer
without a bias whose input size is a multiple of 32. The logits head and the embedding stay in the model dtype (the
head is tied to the embedding in most small models, and lookups gather rows)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from kiln.quant.gguf_blocks import GROUP
from kiln.quant.linear import PackedLinear


def pack_linears(model: nn.Module, is_packed: Callable[[str], bool], scheme: str = "gguf") -> list[str]:
    """Replace each decoder-layer nn.Linear whose checkpoint tensors (HF names) all satisfy `is_packed` by a
    PackedLinear of the same shape and `scheme` (before loading); the replaced weight names."""
    parts: dict[str, list[str]] = {}
    for hf_name, slot in model.checkpoint_slots().items():
        parts.setdefault(slot.param, []).append(hf_name)
    replaced = []
    for name, module in list(model.model.layers.named_modules(prefix="model.layers")):
        if not isinstance(module, nn.Linear) or module.bias is not None or module.in_features % GROUP:
            continue
        weight = f"{name}.weight"
        if weight in parts and all(is_packed(p) for p in parts[weight]):
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name), attr, PackedLinear.like(module, scheme))
            replaced.append(weight)
    return replaced
