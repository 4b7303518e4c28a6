"""What every kiln model class is: `forward(input_ids, positions) -> hidden`, `compute_logits`, and weight loading
from checkpoint tensors by their HF names into kiln's (fused) parameters, checked first against the headers.

A family subclasses `CausalLM` and says how its checkpoint names map onto its parameters:
- `fused_parts()`: kiln parameter name fragments holding several checkpoint tensors stacked by rows (`.qkv_proj.` holds
  `.q_proj.`, `.k_proj.`, `.v_proj.`), with `part_rows` giving each part's rows;
- `extra_slots()`: any other mapping (a mixture-of-experts layer's per-expert tensors into stacked parameters).
Every other parameter is its own checkpoint tensor, by the same name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

from kiln.config import ModelConfig
from kiln.quant.linear import PackedEmbedding, PackedLinear, PackedTensor
from kiln.quant.quantize import quantize

T = TypeVar("T", torch.Tensor, PackedTensor)

# checkpoint tensors kiln accepts and ignores: it recomputes rotary tables (old HF checkpoints store inv_freq)
_DERIVED_SUFFIXES = (".rotary_emb.inv_freq",)


# kiln's fused parameter (name fragment) -> the HF tensors stacked in it, in row order
FUSED: dict[str, tuple[str, ...]] = {
    ".qkv_proj.": (".q_proj.", ".k_proj.", ".v_proj."),
    ".gate_up_proj.": (".gate_proj.", ".up_proj."),
}


class CausalLM(nn.Module):
    """Base of kiln's model classes; subclasses build `self.model` (with `.layers` and `.embed_tokens`) and
    `self.lm_head`, and set `self.config`."""

    config: ModelConfig
    splits_across_ranks = False  # True: the class builds a tensor-parallel shard and a pipeline stage when asked

    def fused_parts(self) -> dict[str, tuple[str, ...]]:
        """Fused parameters whose parts the checkpoint stores apart (default: `FUSED`)."""
        return FUSED

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits for every row of `hidden` (executors may run a faster one-row head of their own)."""
        return self.lm_head(hidden).float()

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], on_tensor: Callable[[str], None] | None = None
    ) -> None:
        """Copy HF-named tensors into kiln's (fused) parameters.

        Every part of every parameter must arrive exactly once with its exact shape: a fused qkv_proj needs q, k
        and v. Anything else raises WeightMismatch naming the tensor at fault, so no parameter keeps its random
        initial values and no checkpoint tensor is silently dropped.
        """
        slots = self.checkpoint_slots()
        params = dict(self.named_parameters())
        packed = _packed_modules(self)
        seen: set[str] = set()
        for name, tensor in weights:
            if on_tensor is not None:
                on_tensor(name)
            if self._is_ignored(name):
                continue
            _check_tensor(slots, seen, name, tuple(tensor.shape))
            self._load_one(name, slots[name], tensor, params, packed)
            seen.add(name)
        _check_all_seen(slots, seen)

    def _load_one(
        self,
        name: str,
        slot: WeightSlot,
        tensor: torch.Tensor | PackedTensor,
        params: dict[str, nn.Parameter],
        packed: dict[str, PackedLinear | PackedEmbedding],
    ) -> None:
        """Copy checkpoint tensor `name` (or this rank's part of it) into its slot."""
        try:
            tensor = slot.take(tensor)  # this rank's shard under tensor parallelism (the whole tensor otherwise)
        except ValueError as exc:  # packed columns that do not split: act-ordered, or a shard between groups
            raise WeightMismatch(name, str(exc)) from None
        with torch.no_grad():
            if slot.param in packed:
                layer = packed[slot.param]
                scheme = getattr(layer, "scheme", "gguf")
                if not isinstance(tensor, PackedTensor) and scheme == "gguf":
                    raise WeightMismatch(name, "is not block-quantized, but its layer was built packed")
                part = tensor if isinstance(tensor, PackedTensor) else quantize(tensor, scheme, layer.group)
                try:
                    layer.load_rows(slot.offset, part)
                except ValueError as exc:  # parts of one fused layer that differ in act order
                    raise WeightMismatch(name, str(exc)) from None
            else:
                value = tensor.dequantize() if isinstance(tensor, PackedTensor) else tensor
                slot.view(params[slot.param]).copy_(value)

    def check_tensors(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """The checks of `load_weights` on a checkpoint's tensor names and shapes alone (read from its headers),
        so a bad checkpoint fails before any weight is read."""
        slots = self.checkpoint_slots()
        seen: set[str] = set()
        for name, shape in shapes.items():
            if not self._is_ignored(name):
                _check_tensor(slots, seen, name, shape)
                seen.add(name)
        _check_all_seen(slots, seen)

    def checkpoint_slots(self) -> dict[str, WeightSlot]:
        """HF tensor name -> where it goes: each fused parameter split into its HF parts."""
        slots: dict[str, WeightSlot] = {}
        weights = {name: tuple(p.shape) for name, p in self.named_parameters()}  # a tied lm_head is embed_tokens
        weights.update({name: (m.out_features, m.in_features) for name, m in _packed_modules(self).items()})
        extra = self.extra_slots()
        taken = {slot.param for slot in extra.values()}
        fused_parts = self.fused_parts()
        for param_name, param_shape in weights.items():
            if param_name in taken:
                continue
            fused = next((frag for frag in fused_parts if frag in param_name), None)
            if fused is None:
                slots[param_name] = WeightSlot(param_name, 0, param_shape)
                continue
            offset = 0
            for part, rows in zip(fused_parts[fused], self.part_rows(param_name, fused), strict=True):
                shape = (rows, *param_shape[1:])
                slots[param_name.replace(fused, part)] = WeightSlot(param_name, offset, shape)
                offset += rows
        return {name: self.shard_slot(name, slot) for name, slot in (slots | extra).items()}

    def shard_slot(self, name: str, slot: WeightSlot) -> WeightSlot:
        """The slot of checkpoint tensor `name` when this rank holds a shard of its parameter (tensor parallelism:
        the checkpoint's full shape, and which rows or columns to take); unchanged by default."""
        return slot

    def part_rows(self, param_name: str, fused: str) -> tuple[int, ...]:
        """Rows of each checkpoint tensor stacked in fused parameter `param_name` (`fused_parts()[fused]`)."""
        c = self.config
        if fused == ".qkv_proj.":
            return (c.q_size, c.kv_size, c.kv_size)
        return (c.intermediate_size, c.intermediate_size)

    def extra_slots(self) -> dict[str, WeightSlot]:
        """Checkpoint tensors that map onto parameters in other ways (default: none)."""
        return {}

    def holds(self, name: str) -> bool:
        """Whether this process loads checkpoint tensor `name` (a pipeline stage holds some layers; default: all)."""
        return True

    def _is_ignored(self, name: str) -> bool:
        # NOTE: tied checkpoints may still carry lm_head.weight (a copy of embed_tokens); the embedding wins.
        tied_head = name == "lm_head.weight" and self.config.tie_word_embeddings
        return tied_head or name.endswith(_DERIVED_SUFFIXES) or not self.holds(name)


@dataclass(frozen=True)
class Shard:
    """The part of a checkpoint tensor one tensor-parallel rank holds: `length` rows (dim 0) or columns (dim 1)
    from `start`."""

    dim: int
    start: int
    length: int


@dataclass(frozen=True)
class WeightSlot:
    """Where one checkpoint tensor (of `shape`) goes: rows [offset, offset + shape[0]) of parameter `param`, or of
    its `expert`-th matrix when the parameter stacks experts; with a `shard`, only that part of it."""

    param: str
    offset: int
    shape: tuple[int, ...]
    expert: int | None = None
    shard: Shard | None = None

    def view(self, param: torch.Tensor) -> torch.Tensor:
        """The slice of `param` this tensor (or its shard) fills."""
        target = param if self.expert is None else param[self.expert]
        rows = self.shard.length if self.shard is not None and self.shard.dim == 0 else self.shape[0]
        return target.narrow(0, self.offset, rows)

    def take(self, tensor: T) -> T:
        """The part of the checkpoint tensor this slot holds (a torch tensor or a PackedTensor). A tensor not read
        yet (kiln.model.loader.hf_loader.TensorReader) is read now: only that part of it."""
        if self.shard is not None:
            return tensor.narrow(self.shard.dim, self.shard.start, self.shard.length)
        whole = getattr(tensor, "whole", None)
        return whole() if whole is not None else tensor


class WeightMismatch(ValueError):
    """Checkpoint tensors that do not fit the model; `tensor` is the HF name at fault, `problem` says how."""

    def __init__(self, tensor: str, problem: str) -> None:
        super().__init__(f"tensor {tensor}: {problem}")
        self.tensor = tensor
        self.problem = problem


def _packed_modules(model: nn.Module) -> dict[str, PackedLinear | PackedEmbedding]:
    """`{"model.layers.0.mlp.down_proj.weight": module}` for every packed layer with a checkpoint tensor of its own
    (not a head tied to the embedding): the weight slot it fills."""
    return {
        f"{name}.weight": m
        for name, m in model.named_modules()
        if isinstance(m, PackedEmbedding) or (isinstance(m, PackedLinear) and not m.tied)
    }


def _check_tensor(slots: dict[str, WeightSlot], seen: set[str], name: str, shape: tuple[int, ...]) -> None:
    if name not in slots:
        raise WeightMismatch(name, "unexpected: the model built from the config has no parameter for it")
    if name in seen:
        raise WeightMismatch(name, "stored twice")
    if shape != slots[name].shape:
        raise WeightMismatch(name, f"shape {shape}, but the config implies {slots[name].shape}")


def _check_all_seen(slots: dict[str, WeightSlot], seen: set[str]) -> None:
    missing = [name for name in slots if name not in seen]
    if missing:
        name, param = missing[0], slots[missing[0]].param
        part = f" (one part of kiln's fused {param})" if name != param else ""
        more = f"; {len(missing) - 1} more tensors are missing" if len(missing) > 1 else ""
        raise WeightMismatch(name, f"missing from the checkpoint{part}{more}")
