"""`attach_lora(model, limits)`: the one change LoRA makes to a model, before an executor prepares it; and
`LoRASlots`, what it returns: load an adapter into a slot, clear a slot, set the step's slot per token.

Each adaptable layer (kiln.lora.targets) becomes a `LoRALinear` around the same base module (as kiln.quant.pack
swaps in packed layers), so the traced graph holds the LoRA buffers as inputs. Every later change is a copy into
those buffers: a loaded, swapped or cleared adapter never recompiles or recaptures a graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch

from kiln.errors import ConfigError
from kiln.lora.checkpoint import LoRAAdapter
from kiln.lora.config import LoRALimits
from kiln.lora.layer import BASE_ONLY, LoRALinear, TokenSlots
from kiln.lora.targets import LoRATarget, lora_targets, parts_by_module
from kiln.lora.validate import check_adapter
from kiln.model.causal_lm import CausalLM
from kiln.quant.linear import PackedLinear


class LoRASlots:
    """`limits.max_loras` adapter slots over one model's LoRALinear layers (made by `attach_lora`)."""

    def __init__(
        self, limits: LoRALimits, targets: dict[str, LoRATarget], layers: dict[str, LoRALinear], tokens: TokenSlots
    ) -> None:
        self.limits = limits
        self.targets = targets  # HF module name -> where it lands
        self.layers = layers  # kiln module path -> its LoRALinear
        self.tokens = tokens
        self.loaded: dict[int, str] = {}  # slot -> the path of the adapter it holds

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Put `adapter` in `slot` (replacing what it held). The adapter is checked against the model and the limits
        first (AdapterError naming the file and field): a bad one changes nothing."""
        self._check_slot(slot)
        check_adapter(adapter, self.targets, self.limits.max_rank)
        self.clear(slot)
        for module, layer in adapter.layers.items():
            target = self.targets[module]
            if target.here:  # else another pipeline stage loads it
                self.layers[target.module].load_part(slot, target.part, target.take(layer))
        self.loaded[slot] = adapter.path

    def clear(self, slot: int) -> None:
        """Empty `slot`: tokens still pointed at it run the base alone."""
        self._check_slot(slot)
        for layer in self.layers.values():
            layer.clear(slot)
        self.loaded.pop(slot, None)

    def set_token_slots(self, slots: torch.Tensor | Sequence[int]) -> None:
        """The step's slot per token, in the flattened batch's order (BASE_ONLY, -1: the base alone); tokens past
        them (padding) run the base alone. Call before each step's forward."""
        slots = torch.as_tensor(slots, dtype=torch.long)
        if slots.numel() and (int(slots.min()) < BASE_ONLY or int(slots.max()) >= self.limits.max_loras):
            raise ValueError(f"token slots must lie in [-1, {self.limits.max_loras - 1}]")
        self.tokens.set(slots)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.limits.max_loras:
            raise ValueError(f"LoRA slot {slot}: the engine holds slots 0 to {self.limits.max_loras - 1} (max_loras)")


def token_slots(query_start_loc: Sequence[int], sequence_slots: Sequence[int]) -> torch.Tensor:
    """Each token's slot from each sequence's (a flattened batch: sequence i's tokens are
    query_start_loc[i] .. query_start_loc[i + 1])."""
    counts = torch.tensor([b - a for a, b in pairwise(query_start_loc)])
    return torch.repeat_interleave(torch.tensor(list(sequence_slots), dtype=torch.long), counts)


def attach_lora(model: CausalLM, limits: LoRALimits) -> LoRASlots:
    """Make every adaptable layer of `model` a LoRALinear with `limits`' slots (all empty) and return the slots.
    Call once, after the weights load and before an executor prepares the model."""
    targets = lora_targets(model)
    if not targets:
        raise ConfigError(f"{model.config.architecture}: the model has no layer kiln can adapt with LoRA")
    floats = [p for p in model.parameters() if p.is_floating_point()]
    packed = any(isinstance(model.get_submodule(module), PackedLinear) for module in parts_by_module(targets))
    device, dtype = floats[0].device, limits.buffer_dtype(floats[0].dtype, packed=packed)
    tokens = TokenSlots(limits.max_num_tokens, device)
    layers: dict[str, LoRALinear] = {}
    for module, parts in parts_by_module(targets).items():
        parent, _, name = module.rpartition(".")
        layer = LoRALinear(model.get_submodule(module), parts=parts, limits=limits, tokens=tokens, dtype=dtype)
        setattr(model.get_submodule(parent), name, layer)
        layers[module] = layer
    return LoRASlots(limits, targets, layers, tokens)
