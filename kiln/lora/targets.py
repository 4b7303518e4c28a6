"""Where a PEFT adapter's layers land in a kiln model: HF linear layer (`model.layers.0.self_attn.q_proj`) -> part of
kiln's (possibly fused) module, read from the model's own checkpoint mapping (`CausalLM.checkpoint_slots`), so
every family's fusing (qkv_proj, gate_up_proj, or a checkpoint that stores them fused) is sliced as its weights are.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from kiln.errors import ConfigError
from kiln.model.causal_lm import CausalLM
from kiln.quant.linear import PackedLinear

# the last name of each HF linear layer kiln adapts (Phi-3's checkpoints store qkv_proj and gate_up_proj fused)
TARGET_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
)
DECODER_PREFIX = "model.layers."


@dataclass(frozen=True)
class LoRATarget:
    """One adaptable HF linear layer: part `part` of kiln's module `module`, i.e. output rows [offset, offset + rows)
    of that module, which takes `in_features` inputs."""

    module: str
    part: int
    offset: int
    rows: int
    in_features: int


def lora_targets(model: CausalLM) -> dict[str, LoRATarget]:
    """Every adaptable HF linear layer of the model's decoder, by its HF module name. Raises ConfigError under
    tensor parallelism (a rank holds a shard of each layer; adapters are not sharded yet)."""
    parts: dict[str, list[tuple[int, str, int]]] = {}  # kiln module -> (row offset, HF module, rows)
    for name, slot in model.checkpoint_slots().items():
        hf_module = name.removesuffix(".weight")
        short = hf_module.rpartition(".")[2]
        if not name.endswith(".weight") or short not in TARGET_MODULES or not name.startswith(DECODER_PREFIX):
            continue
        if slot.expert is not None:
            continue  # a mixture-of-experts layer's stacked experts: not adaptable
        module = slot.param.removesuffix(".weight")
        if not isinstance(model.get_submodule(module), (nn.Linear, PackedLinear)):
            continue
        if slot.shard is not None:
            raise ConfigError("LoRA adapters under tensor parallelism are not supported yet: use one rank")
        parts.setdefault(module, []).append((slot.offset, hf_module, slot.shape[0]))
    targets: dict[str, LoRATarget] = {}
    for module, found in parts.items():
        in_features = model.get_submodule(module).in_features
        for part, (offset, hf_module, rows) in enumerate(sorted(found)):
            targets[hf_module] = LoRATarget(module=module, part=part, offset=offset, rows=rows, in_features=in_features)
    return targets


def parts_by_module(targets: dict[str, LoRATarget]) -> dict[str, list[LoRATarget]]:
    """kiln module -> its parts' targets, in row order."""
    modules: dict[str, list[LoRATarget]] = {}
    for target in sorted(targets.values(), key=lambda t: (t.module, t.part)):
        modules.setdefault(target.module, []).append(target)
    return modules
