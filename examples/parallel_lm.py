"""A made-up architecture brought up on kiln (docs/bring-up.md): ParallelLM.

Each block computes attention and its gated MLP from the same normed input and adds both to the residual (GPT-J's
parallel block), with one RMSNorm per block. Its checkpoints use names of their own (`transformer.h.3.attn.wqkv`)
and store q/k/v and gate/up already fused. `register()` runs at import, so

    KILN_MODEL_PLUGINS=examples.parallel_lm kiln serve --model DIR

serves a checkpoint whose config.json says `"architectures": ["ParallelLMForCausalLM"]`.

    python -m examples.parallel_lm DIR [--draft]     # writes a small random checkpoint there
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln import models

ARCHITECTURE = "ParallelLMForCausalLM"
DRAFT = "ParallelLMDraftForCausalLM"  # the same model before bring-up fixed its graph break


@dataclass(frozen=True)
class ParallelLMSettings:
    """ParallelLM's own settings (`ModelConfig.own`): `parallel_residual` (false: a sequential block, as Llama's)."""

    parallel_residual: bool = True


def read_config(view: models.ConfigView, config: models.ModelConfig) -> models.ModelConfig:
    """ParallelLM's own config.json field, read into `config.own`."""
    return replace(config, own=ParallelLMSettings(parallel_residual=view.flag("parallel_residual", True)))


class Attention(nn.Module):
    def __init__(self, config: models.ModelConfig, layer_idx: int, rotary: models.RotaryEmbedding) -> None:
        super().__init__()
        self.layer_idx, self.q_size, self.kv_size = layer_idx, config.q_size, config.kv_size
        self.qkv_proj = nn.Linear(config.hidden_size, config.q_size + 2 * config.kv_size, bias=False)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=False)
        self.rotary_emb = rotary

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(models.attend(q, k.contiguous(), v.contiguous(), self.layer_idx))


class Block(nn.Module):
    def __init__(self, config: models.ModelConfig, layer_idx: int, rotary: models.RotaryEmbedding) -> None:
        super().__init__()
        settings = config.own
        if not isinstance(settings, ParallelLMSettings):
            raise TypeError(f"ParallelLM needs its own settings (read_config), found {settings!r}")
        self.parallel = settings.parallel_residual
        self.norm = models.RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx, rotary)
        self.mlp = models.MLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        x = self.norm(hidden)
        if self.parallel:
            return hidden + self.self_attn(positions, x) + self.mlp(x)
        hidden = hidden + self.self_attn(positions, x)
        return hidden + self.mlp(self.norm(hidden))


class ParallelModel(nn.Module):
    def __init__(self, config: models.ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.rotary_emb = models.RotaryEmbedding(config, max_positions)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i, self.rotary_emb) for i in range(config.num_layers))
        self.norm = models.RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)


class ParallelLMForCausalLM(models.CausalLM):
    def __init__(self, config: models.ModelConfig, max_positions: int, freq_factors: Any = None) -> None:
        super().__init__()
        self.config = config
        self.model = ParallelModel(config, max_positions)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight  # tied, as its checkpoints store no head

    def fused_parts(self) -> dict[str, tuple[str, ...]]:
        return {}  # the checkpoint stores wqkv and w_in fused, as kiln's qkv_proj and gate_up_proj

    def extra_slots(self) -> dict[str, models.WeightSlot]:
        """Checkpoint name -> kiln parameter (every parameter has its own checkpoint tensor, renamed)."""
        return {
            checkpoint: models.WeightSlot(param, 0, tuple(p.shape)) for checkpoint, param, p in checkpoint_names(self)
        }


class DraftBlock(Block):
    """The first draft of the block (docs/bring-up.md): it checks its positions on the host, a data-dependent
    branch that `kiln debug explain` reports as a graph break."""

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        if positions.max() >= self.self_attn.rotary_emb.cos_cache.shape[0]:
            raise ValueError("a position past the rotary table")
        return super().forward(positions, hidden)


class ParallelLMDraftForCausalLM(ParallelLMForCausalLM):
    def __init__(self, config: models.ModelConfig, max_positions: int, freq_factors: Any = None) -> None:
        super().__init__(config, max_positions)
        rotary = self.model.rotary_emb
        self.model.layers = nn.ModuleList(DraftBlock(config, i, rotary) for i in range(config.num_layers))


def checkpoint_names(model: nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    """(checkpoint name, kiln parameter name, parameter) for every parameter of a ParallelLM model."""
    renames = {
        "model.embed_tokens.": "transformer.wte.",
        "model.norm.": "transformer.ln_f.",
        "model.layers.": "transformer.h.",
        ".self_attn.qkv_proj.": ".attn.wqkv.",
        ".self_attn.o_proj.": ".attn.wo.",
        ".mlp.gate_up_proj.": ".ffn.w_in.",
        ".mlp.down_proj.": ".ffn.w_out.",
        ".norm.": ".ln.",
    }
    out = []
    for name, param in model.named_parameters():  # a tied head shares the embedding: listed once
        checkpoint = name
        for old, new in renames.items():
            checkpoint = checkpoint.replace(old, new)
        out.append((checkpoint, name, param))
    return out


CONFIG = {
    "architectures": [ARCHITECTURE],
    "vocab_size": 49152,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "parallel_residual": True,
    "eos_token_id": 2,
}


def write_checkpoint(directory: Path, config: dict[str, Any] | None = None, tokenizer_json: str | None = None) -> None:
    """A random ParallelLM checkpoint in `directory`: config.json, model.safetensors (its own tensor names) and
    tokenizer.json (the default model's tokenizer unless `tokenizer_json` is given)."""
    from safetensors.torch import save_file

    from kiln.model.loader.hf_config import parse_config

    config = {**CONFIG, **(config or {})}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    torch.manual_seed(0)
    model = ParallelLMForCausalLM(parse_config(directory / "config.json"), 16)
    with torch.no_grad():
        for _, _, param in checkpoint_names(model):
            param.normal_(0.0, 0.05).add_(1.0 if param.dim() == 1 else 0.0)  # norms around one
    save_file({c: p.detach().contiguous() for c, _, p in checkpoint_names(model)}, directory / "model.safetensors")
    if tokenizer_json is None:
        from kiln.model.loader import GGUFCheckpoint, default_model_path
        from kiln.model.tokenizer import KilnTokenizer

        tokenizer_json = KilnTokenizer.from_gguf(GGUFCheckpoint(default_model_path())).tokenizer.to_str()
    (directory / "tokenizer.json").write_text(tokenizer_json)
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": None}))


models.register(ARCHITECTURE, ParallelLMForCausalLM, architecture="parallel_lm", read_config=read_config)
models.register(DRAFT, ParallelLMDraftForCausalLM, architecture="parallel_lm_draft", read_config=read_config)

if __name__ == "__main__":
    draft = "--draft" in sys.argv[2:]
    write_checkpoint(Path(sys.argv[1]), {"architectures": [DRAFT]} if draft else None)
    print(f"wrote a random ParallelLM{' (draft)' if draft else ''} checkpoint to {sys.argv[1]}")
