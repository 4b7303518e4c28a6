"""Where a PEFT adapter's layers land in a kiln model: HF linear layer (`model.layers.0.self_attn.q_proj`) -> part of
kiln's (possibly fused) module, read from the model's own checkpoint mapping (`CausalLM.checkpoint_slots`), so
every family's fusing (qkv_proj, gate_up_proj, or a checkpoint that stores them fused) is sliced as its weights are.

On several devices an adapter is split as its base layers are (vLLM's and S-LoRA's layout):
- tensor parallelism: a column-parallel layer (q/k/v, gate/up) holds some output rows, so the rank takes the same
  rows of B and the whole of A; a row-parallel one (o_proj, down_proj) holds some input columns, so the rank takes
  those columns of A and the whole of B. Each rank's delta x_r A_r^T B^T is then a partial sum like its base
  product's, and the all-reduce after the layer adds both: no collective of its own.
- pipeline parallelism: a stage holds its layers' targets; the layers of other stages are checked here against a
  held layer of the same name (decoder layers of one model share their shapes) and loaded where they are held.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from torch import nn

from kiln.errors import ConfigError
from kiln.lora.checkpoint import LoRALayer
from kiln.model.causal_lm import CausalLM, Shard
from kiln.model.parallel import held_layers
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
DECODER_LAYER = re.compile(rf"{re.escape(DECODER_PREFIX)}(?P<index>\d+)\.(?P<rest>.+)")


@dataclass(frozen=True)
class LoRATarget:
    """One adaptable HF linear layer: part `part` of kiln's module `module`, i.e. output rows [offset, offset + rows)
    of that module, which takes `in_features` inputs (this rank's sizes). `shape`: the HF layer's whole weight
    [out, in], which an adapter's tensors must fit; under tensor parallelism the rank holds `shard` of it and takes
    the same part of each adapter (`take`). `module` None: another pipeline stage holds the layer."""

    module: str | None
    part: int
    offset: int
    rows: int
    in_features: int
    shape: tuple[int, int]
    shard: Shard | None = None

    @property
    def here(self) -> bool:
        return self.module is not None

    def take(self, layer: LoRALayer) -> LoRALayer:
        """This rank's part of an adapter's layer (module docstring): B's rows of a column-parallel shard, A's
        columns of a row-parallel one; the whole layer when nothing is split."""
        if self.shard is None:
            return layer
        start, length = self.shard.start, self.shard.length
        if self.shard.dim == 0:
            return replace(layer, b=layer.b.narrow(0, start, length))
        return replace(layer, a=layer.a.narrow(1, start, length))


def lora_targets(model: CausalLM) -> dict[str, LoRATarget]:
    """Every adaptable HF linear layer of the model's decoder, by its HF module name: this rank's, and under
    pipeline parallelism the other stages' (module None)."""
    parts: dict[str, list[tuple[int, str, int, Shard | None]]] = {}  # kiln module -> (offset, HF module, rows, shard)
    shapes: dict[str, tuple[int, int]] = {}  # HF module -> its whole weight's shape
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
        rows = slot.shard.length if slot.shard is not None and slot.shard.dim == 0 else slot.shape[0]
        parts.setdefault(module, []).append((slot.offset, hf_module, rows, slot.shard))
        shapes[hf_module] = (slot.shape[0], slot.shape[1])
    targets: dict[str, LoRATarget] = {}
    for module, found in parts.items():
        in_features = model.get_submodule(module).in_features
        for part, (offset, hf_module, rows, shard) in enumerate(sorted(found, key=lambda p: p[0])):
            targets[hf_module] = LoRATarget(
                module=module,
                part=part,
                offset=offset,
                rows=rows,
                in_features=in_features,
                shape=shapes[hf_module],
                shard=shard,
            )
    return targets | _held_elsewhere(model, targets)


def _held_elsewhere(model: CausalLM, targets: dict[str, LoRATarget]) -> dict[str, LoRATarget]:
    """The targets of the decoder layers another pipeline stage holds, shaped as this stage's layer of the same
    name (none without pipeline parallelism)."""
    held = held_layers(model)
    if held is None:
        return {}
    if model.config.num_experts:
        # NOTE: a sparse model may mix dense and sparse layers, so a held layer does not say what another stage's is
        raise ConfigError(
            f"{model.config.architecture}: LoRA adapters on a mixture-of-experts model run on one pipeline stage "
            "(--pipeline-parallel-size 1)"
        )
    template: dict[str, LoRATarget] = {}  # the HF name after the layer index -> a held layer's target
    for name, target in targets.items():
        found = DECODER_LAYER.fullmatch(name)
        if found is not None:
            template.setdefault(found["rest"], target)
    return {
        f"{DECODER_PREFIX}{i}.{rest}": replace(target, module=None, shard=None)
        for i in range(model.config.num_layers)
        if i not in held
        for rest, target in template.items()
    }


def parts_by_module(targets: dict[str, LoRATarget]) -> dict[str, list[LoRATarget]]:
    """kiln module -> its parts' targets, in row order (this rank's modules only)."""
    modules: dict[str, list[LoRATarget]] = {}
    for target in sorted((t for t in targets.values() if t.module is not None), key=lambda t: (t.module, t.part)):
        modules.setdefault(target.module, []).append(target)
    return modules
