"""Gemma 2 and Gemma 3 (text) on kiln's layers and paged attention op (kiln.model.gemma_config reads their configs).

What sets them apart from the Llama shape (all read from the config, never from the family name):
- RMSNorm scales by (1 + weight), in fp32 before the cast back (`GemmaRMSNorm`);
- "sandwich" norms: the attention and MLP outputs are normalized again before their residual adds;
- the embedding is multiplied by sqrt(hidden_size), rounded to the model dtype as HF does;
- attention scores are scaled by query_pre_attn_scalar**-0.5 instead of head_dim**-0.5;
- sliding-window and global layers alternate (`layer_types`);
- Gemma 2: attention-logit soft-capping (tanh(s / cap) * cap) inside the attention op;
- Gemma 3: RMSNorm over each q/k head, and the sliding layers' rotary base is rope_local_base_freq;
- the logits are soft-capped by final_logit_softcapping when the config sets it.

`forward(input_ids[num_tokens], positions[num_tokens]) -> hidden[num_tokens, hidden]`; module paths match HF
(`model.layers.3.pre_feedforward_layernorm`), q/k/v and gate/up fused as in kiln.model.llama.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

import kiln.model.attention  # noqa: F401  (registers torch.ops.kiln.attention)
from kiln.config import ModelConfig
from kiln.model.causal_lm import CausalLM
from kiln.model.graph_attention import attend
from kiln.model.layers import MLP, RotaryEmbedding, per_head

__all__ = ["GemmaForCausalLM"]


class GemmaRMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * (1 + weight), computed in fp32 and cast back (HF's Gemma2RMSNorm)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: unlike Llama's RMSNorm, the weight multiplies before the cast to the model dtype (HF PR 29402)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class SoftCappedHead(nn.Module):
    """The logits head with final soft-capping: fp32 tanh(logits / cap) * cap."""

    def __init__(self, hidden_size: int, vocab_size: int, cap: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.cap = cap

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # NOTE: capped in fp32 (HF caps in the model dtype; equal in fp32, closer to exact in bf16)
        logits = nn.functional.linear(hidden, self.weight).float()
        return torch.tanh(logits / self.cap) * self.cap


class GemmaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.window = config.layer_window(layer_idx)
        self.softcap = float(config.attn_logit_softcapping)
        self.q_size, self.kv_size, self.head_dim = config.q_size, config.kv_size, config.head_dim
        # NOTE: the op scales scores by head_dim**-0.5; Gemma's scale is query_pre_attn_scalar**-0.5, so q is
        # pre-multiplied by the ratio's square root (1.0 for most Gemmas, where the two are equal: then skipped)
        self.q_scale = (config.head_dim / (config.query_pre_attn_scalar or config.head_dim)) ** 0.5
        bias = config.attention_bias
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bias)
        self.rotary_emb = rotary  # shared by the layers of its kind (sliding or global): one table each
        self.q_norm = self.k_norm = None
        if config.qk_norm:  # Gemma 3: RMSNorm over each head before the rotary embedding
            self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = per_head(self.q_norm, q, self.head_dim), per_head(self.k_norm, k, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        out = attend(q, k.contiguous(), v.contiguous(), self.layer_idx, self.window, self.softcap)
        return self.o_proj(out)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = GemmaAttention(config, layer_idx, rotary)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = MLP(h, config.intermediate_size, config.hidden_act)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(hidden)))
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class GemmaModel(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, freq_factors: torch.Tensor | None = None) -> None:
        super().__init__()
        self.rotary_emb = RotaryEmbedding(config, max_positions, freq_factors)
        rotary = [self.rotary_emb] * config.num_layers
        local_base = config.rope_local_base_freq
        if local_base is not None:  # Gemma 3: sliding layers rotate with their own base and no scaling
            local = replace(config, rope_theta=local_base, rope_scaling=None)
            self.rotary_emb_local = RotaryEmbedding(local, max_positions)
            rotary = [self.rotary_emb_local if config.layer_window(i) else self.rotary_emb for i in range(len(rotary))]
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # NOTE: fp32 here (buffers keep their dtype at load); cast to the model dtype where used, as HF does, so
        # bf16 multiplies by bf16(sqrt(hidden)) (55.5 for 3072), the value Gemma was trained with
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5), persistent=False)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i, rotary[i]) for i in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * self.embed_scale.to(hidden.dtype)
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)


class GemmaForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, max_positions: int, freq_factors: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = GemmaModel(config, max_positions, freq_factors)
        cap = config.final_logit_softcapping
        # NOTE: a capped head is not an nn.Linear, so the executors' one-row fast heads (which would skip the
        # cap) leave it alone and every logit goes through compute_logits
        if cap:
            self.lm_head: nn.Module = SoftCappedHead(config.hidden_size, config.vocab_size, cap)
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
