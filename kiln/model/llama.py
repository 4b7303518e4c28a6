"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2) on kiln's layers and paged attention op.

`forward(input_ids[num_tokens], positions[num_tokens]) -> hidden[num_tokens, hidden]` over a flattened
batch; attention metadata comes from the forward context. Module paths match HF (`model.layers.17.mlp`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

import kiln.model.attention  # noqa: F401  (registers torch.ops.kiln.attention)
from kiln.config import ModelConfig
from kiln.model.graph_attention import attend
from kiln.model.layers import MLP, RMSNorm, RotaryEmbedding
from kiln.quant.linear import PackedEmbedding, PackedLinear, PackedTensor
from kiln.quant.quantize import quantize

# kiln's fused parameter (name fragment) -> the HF projections stacked in it, in row order
_FUSED = {
    ".qkv_proj.": (".q_proj.", ".k_proj.", ".v_proj."),
    ".gate_up_proj.": (".gate_proj.", ".up_proj."),
}
# checkpoint tensors kiln accepts and ignores: it recomputes rotary tables (old HF checkpoints store inv_freq)
_DERIVED_SUFFIXES = (".rotary_emb.inv_freq",)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.rotary_emb = rotary  # one shared instance: its cos/sin tables exist once

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        out = attend(q, k.contiguous(), v.contiguous(), self.layer_idx)
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, freq_factors: torch.Tensor | None = None) -> None:
        super().__init__()
        self.rotary_emb = RotaryEmbedding(config, max_positions, freq_factors)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, self.rotary_emb) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, freq_factors: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, max_positions, freq_factors)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

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
            slot = slots[name]
            with torch.no_grad():
                if slot.param in packed:
                    layer = packed[slot.param]
                    scheme = getattr(layer, "scheme", "gguf")
                    if not isinstance(tensor, PackedTensor) and scheme == "gguf":
                        raise WeightMismatch(name, "is not block-quantized, but its layer was built packed")
                    part = tensor if isinstance(tensor, PackedTensor) else quantize(tensor, scheme, layer.group)
                    layer.load_rows(slot.offset, part)
                else:
                    value = tensor.dequantize() if isinstance(tensor, PackedTensor) else tensor
                    params[slot.param].narrow(0, slot.offset, slot.shape[0]).copy_(value)
            seen.add(name)
        _check_all_seen(slots, seen)

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
        for param_name, param_shape in weights.items():
            fused = next((frag for frag in _FUSED if frag in param_name), None)
            if fused is None:
                slots[param_name] = WeightSlot(param_name, 0, param_shape)
                continue
            offset = 0
            for part, rows in zip(_FUSED[fused], self._part_rows(fused), strict=True):
                shape = (rows, *param_shape[1:])
                slots[param_name.replace(fused, part)] = WeightSlot(param_name, offset, shape)
                offset += rows
        return slots

    def _part_rows(self, fused: str) -> tuple[int, ...]:
        c = self.config
        if fused == ".qkv_proj.":
            return (c.q_size, c.kv_size, c.kv_size)
        return (c.intermediate_size, c.intermediate_size)

    def _is_ignored(self, name: str) -> bool:
        # NOTE: tied checkpoints may still carry lm_head.weight (a copy of embed_tokens); the embedding wins.
        tied_head = name == "lm_head.weight" and self.config.tie_word_embeddings
        return tied_head or name.endswith(_DERIVED_SUFFIXES)


@dataclass(frozen=True)
class WeightSlot:
    """Where one checkpoint tensor goes: rows [offset, offset + shape[0]) of parameter `param`."""

    param: str
    offset: int
    shape: tuple[int, ...]


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
