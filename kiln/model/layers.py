"""Building blocks of the Llama family: RMSNorm, rotary embedding (with scaling), SiLU-gated MLP."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from kiln.config import ModelConfig
from kiln.distributed.sharding import SINGLE, TensorParallel
from kiln.errors import ConfigError
from kiln.model.parallel import reduce_partial


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: statistics in fp32 whatever the model dtype, as HF does; parity depends on it.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def per_head(norm: nn.Module, x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """`norm` over each head of x [tokens, heads * head_dim] (Qwen3's and Gemma 3's q/k norms)."""
    n = x.shape[0]
    return norm(x.reshape(n, -1, head_dim)).view(n, x.shape[1])


RopeScaling = Callable[[torch.Tensor, dict[str, Any], "torch.Tensor | None"], tuple[torch.Tensor, float]]


def _linear(inv_freq: torch.Tensor, scaling: dict[str, Any], _: torch.Tensor | None) -> tuple[torch.Tensor, float]:
    return inv_freq, 1.0 / float(scaling["factor"])


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, Any], _: torch.Tensor | None) -> tuple[torch.Tensor, float]:
    factor = float(scaling["factor"])
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    inv_freq = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    is_medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(is_medium, smoothed, inv_freq), 1.0


def _longrope(inv_freq: torch.Tensor, scaling: dict[str, Any], _: torch.Tensor | None) -> tuple[torch.Tensor, float]:
    """The short factors; RotaryEmbedding switches to the long ones past the original length."""
    return inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float32), 1.0


def _freq_factors(
    inv_freq: torch.Tensor, _: dict[str, Any], freq_factors: torch.Tensor | None
) -> tuple[torch.Tensor, float]:
    if freq_factors is None:
        raise ValueError("rope_type freq_factors needs the checkpoint's rope_freqs tensor")
    return inv_freq / freq_factors.float(), 1.0


# rope scaling kind (HF's rope_type, or GGUF's per-frequency factors) -> (inverse frequencies, position scale)
ROPE_SCALINGS: dict[str, RopeScaling] = {
    "default": lambda inv_freq, _, __: (inv_freq, 1.0),
    "linear": _linear,
    "llama3": _llama3,
    "longrope": _longrope,
    "freq_factors": _freq_factors,
}


def rope_inv_freq(config: ModelConfig, freq_factors: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and a position scale for the config's rope scaling (one of ROPE_SCALINGS)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = dict(config.rope_scaling or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_SCALINGS:
        known = ", ".join(k for k in ROPE_SCALINGS if k != "default")
        raise ConfigError(f"unsupported rope scaling {kind!r}: kiln runs {known}")
    return ROPE_SCALINGS[kind](inv_freq, scaling, freq_factors)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE over a precomputed cos/sin table indexed by position."""

    def __init__(self, config: ModelConfig, max_positions: int, freq_factors: torch.Tensor | None = None) -> None:
        super().__init__()
        inv_freq, scale = rope_inv_freq(config, freq_factors)
        t = torch.arange(max_positions, dtype=torch.int64).float() * scale
        freqs = torch.outer(t, inv_freq)
        magnitude = 1.0
        scaling = config.rope_scaling or {}
        if scaling.get("rope_type") == "longrope":
            # NOTE: per position, as vLLM does: positions past the pretraining length take the long factors (HF
            # switches every position of a forward once the sequence passes it; equal below that length)
            long = torch.outer(
                t, inv_freq * torch.tensor(scaling["short_factor"]) / torch.tensor(scaling["long_factor"])
            )
            freqs = torch.where(t[:, None] >= scaling["original_max_position_embeddings"], long, freqs)
            magnitude = scaling["attention_factor"]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos() * magnitude, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * magnitude, persistent=False)
        self.head_dim = config.head_dim

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = positions.shape[0]
        cos = self.cos_cache[positions].unsqueeze(1)  # [n, 1, D]
        sin = self.sin_cache[positions].unsqueeze(1)
        qh = q.view(n, -1, self.head_dim)
        kh = k.view(n, -1, self.head_dim)
        q_out = (qh.float() * cos + _rotate_half(qh.float()) * sin).to(q.dtype)
        k_out = (kh.float() * cos + _rotate_half(kh.float()) * sin).to(k.dtype)
        return q_out.view(n, -1), k_out.view(n, -1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# a gated MLP's activation (kiln's name, kiln.model.loader.base.ACTIVATIONS) -> the function of its gate half
GLU_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": nn.functional.silu,  # SwiGLU: Llama, Qwen, Mistral, Phi-3, the MoE families
    "gelu_tanh": partial(nn.functional.gelu, approximate="tanh"),  # GeGLU: Gemma
}


class MLP(nn.Module):
    """A gated MLP, down(act(gate(x)) * up(x)), gate and up fused in one matmul (SwiGLU unless `activation`).

    Under tensor parallelism gate_up is column-parallel and down row-parallel: each rank holds 1/N of the
    intermediate columns and the partial outputs are summed."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, activation: str = "silu", tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        _, intermediate_size = tp.span(intermediate_size, "the MLP's intermediate size")
        self.tp = tp
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.intermediate_size = intermediate_size
        self.act = GLU_ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return reduce_partial(self.down_proj(self.act(gate) * up), self.tp)
