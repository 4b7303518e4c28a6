"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2) on kiln's layers and paged attention op.

`forward(input_ids[num_tokens], positions[num_tokens]) -> hidden[num_tokens, hidden]` over a flattened
batch; attention metadata comes from the forward context. Module paths match HF (`model.layers.17.mlp`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

import kiln.model.attention  # noqa: F401  (registers torch.ops.kiln.attention)
from kiln.config import ModelConfig
from kiln.model.layers import MLP, RMSNorm, RotaryEmbedding

# HF checkpoint name fragment -> (kiln parameter fragment, shard index) for fused projections
_STACKED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


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
        out = torch.ops.kiln.attention(q, k.contiguous(), v.contiguous(), self.layer_idx)
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
        """Copy HF-named tensors into kiln's (fused) parameters; every parameter must be covered."""
        params = dict(self.named_parameters())
        filled: dict[str, int] = {}
        for name, tensor in weights:
            if on_tensor is not None:
                on_tensor(name)
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target, shard = name, None
            for frag, (fused, idx) in _STACKED.items():
                if frag in name:
                    target, shard = name.replace(frag, fused), idx
                    break
            if target not in params:
                raise KeyError(f"checkpoint tensor {name} has no matching parameter in {type(self).__name__}")
            param = params[target]
            with torch.no_grad():
                if shard is None:
                    _copy_checked(param, tensor, name)
                else:
                    sizes = self._shard_sizes(target)
                    offset = sum(sizes[:shard])
                    _copy_checked(param.narrow(0, offset, sizes[shard]), tensor, name)
            filled[target] = filled.get(target, 0) + 1
        missing = [n for n in params if n not in filled]
        if missing:
            raise KeyError(f"checkpoint has no tensor for {len(missing)} parameters, e.g. {missing[0]}")

    def _shard_sizes(self, fused_name: str) -> list[int]:
        c = self.config
        if ".qkv_proj." in fused_name:
            return [c.q_size, c.kv_size, c.kv_size]
        return [c.intermediate_size, c.intermediate_size]


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"tensor {name}: checkpoint shape {tuple(src.shape)} != model shape {tuple(dst.shape)}")
    dst.copy_(src)
