"""The Llama-shaped families on kiln's layers and paged attention op: Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3
(q/k RMSNorm per head), Phi-3 (qkv and gate_up fused in the checkpoint, long-rope), and the mixture-of-experts
families Mixtral, Qwen2-MoE (shared expert) and Qwen3-MoE, whose MLP is kiln's fused-MoE op.

`forward(input_ids[num_tokens], positions[num_tokens]) -> hidden[num_tokens, hidden]` over a flattened
batch; attention metadata comes from the forward context. Module paths match HF (`model.layers.17.mlp`).
What differs between the families is read from the config (kiln.model.family_configs), never from its name.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch
from torch import nn

import kiln.model.attention  # noqa: F401  (registers torch.ops.kiln.attention)
from kiln.config import ModelConfig
from kiln.distributed.sharding import SINGLE, WHOLE, PipelineStage, TensorParallel
from kiln.distributed.state import pipeline_stage, tensor_parallel
from kiln.model.causal_lm import CausalLM, WeightMismatch, WeightSlot
from kiln.model.graph_attention import attend
from kiln.model.layers import MLP, RMSNorm, RotaryEmbedding, per_head
from kiln.model.moe import FusedMoE
from kiln.model.parallel import check_splittable, embed, reduce_partial
from kiln.model.tp_slots import shard_slot, split_part_rows

__all__ = ["LlamaForCausalLM", "WeightMismatch"]

LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")


class Attention(nn.Module):
    """Under tensor parallelism a rank holds some heads (kiln.distributed.sharding): qkv_proj is column-parallel,
    o_proj row-parallel, and the rank's KV cache holds its KV heads only."""

    def __init__(
        self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.window = config.layer_window(layer_idx)
        self.tp = tp
        heads = tp.heads(config.num_heads, config.num_kv_heads)
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = heads.q_count * config.head_dim, heads.kv_count * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.rotary_emb = rotary  # one shared instance: its cos/sin tables exist once
        self.q_norm = self.k_norm = None
        if config.qk_norm:  # Qwen3: RMSNorm over each head before the rotary embedding
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = per_head(self.q_norm, q, self.head_dim), per_head(self.k_norm, k, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        out = attend(q, k.contiguous(), v.contiguous(), self.layer_idx, self.window)
        return reduce_partial(self.o_proj(out), self.tp)


def make_mlp(config: ModelConfig, layer_idx: int, tp: TensorParallel = SINGLE) -> nn.Module:
    moe = config.moe
    if moe is None or not moe.is_sparse(layer_idx):
        return MLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp)
    return FusedMoE(
        config.hidden_size,
        moe.intermediate_size,
        moe.num_experts,
        moe.num_experts_per_tok,
        moe.norm_topk_prob,
        config.hidden_act,
        moe.shared_expert_intermediate_size,
    )


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx, rotary, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = make_mlp(config, layer_idx, tp)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class MissingLayer(nn.Module):
    """A decoder layer another pipeline stage runs: no weights here."""


class LlamaModel(nn.Module):
    """Under pipeline parallelism (`stage`) the model holds its stage's layers only: the first stage embeds, the
    others receive the previous stage's hidden states; the last applies the final norm, the others send theirs on."""

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        freq_factors: torch.Tensor | None = None,
        tp: TensorParallel = SINGLE,
        stage: PipelineStage = WHOLE,
    ) -> None:
        super().__init__()
        self.tp, self.stage, self.vocab_size, self.hidden_size = tp, stage, config.vocab_size, config.hidden_size
        self.rotary_emb = RotaryEmbedding(config, max_positions, freq_factors)
        self.embed_tokens: nn.Module | None = None
        if stage.is_first or (stage.is_last and config.tie_word_embeddings):  # the last stage's tied head needs it
            self.embed_tokens = nn.Embedding(tp.vocab_span(config.vocab_size)[2], config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, self.rotary_emb, tp) if stage.holds_layer(i) else MissingLayer()
            for i in range(config.num_layers)
        )
        self.held = [i for i in range(config.num_layers) if stage.holds_layer(i)]
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if stage.is_last else None

    @contextmanager
    def tracing_layers(self, layers: list[int]) -> Iterator[None]:
        """Run only `layers` of the held ones (a trace of a few from which kiln.compile.stamp copies the rest)."""
        held, self.held = self.held, layers
        try:
            yield
        finally:
            self.held = held

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.stage.prev_rank is None:
            hidden = embed(self.embed_tokens, input_ids, self.tp, self.vocab_size)
        else:
            dtype = self.layers[self.held[0]].input_layernorm.weight.dtype
            hidden = torch.ops.kiln.recv_prev(input_ids, self.hidden_size, dtype, self.stage.prev_rank)
        for i in self.held:
            hidden = self.layers[i](positions, hidden)
        if self.stage.next_rank is not None:
            return torch.ops.kiln.send_next(hidden, self.stage.next_rank)
        return self.norm(hidden)


class LlamaForCausalLM(CausalLM):
    splits_across_ranks = True

    def __init__(self, config: ModelConfig, max_positions: int, freq_factors: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp = tensor_parallel()  # this process's tensor-parallel rank (size 1 unless distributed)
        self.stage = stage = pipeline_stage(config.num_layers)  # and its pipeline stage (every layer unless split)
        check_splittable(config, tp.size)
        self.model = LlamaModel(config, max_positions, freq_factors, tp, stage)
        # a vocab-parallel head: each rank's logits for its vocabulary slice (gathered by the model runner)
        self.lm_head: nn.Module | None = None
        if stage.is_last:
            self.lm_head = nn.Linear(config.hidden_size, tp.vocab_span(config.vocab_size)[2], bias=False)
            if config.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight

    def fused_parts(self) -> dict[str, tuple[str, ...]]:
        # Phi-3 stores qkv_proj and gate_up_proj fused, as kiln does
        return {} if self.config.fused_checkpoint else super().fused_parts()

    def part_rows(self, param_name: str, fused: str) -> tuple[int, ...]:
        if self.tp.is_split:
            return split_part_rows(self.config, self.tp, fused)
        return super().part_rows(param_name, fused)

    def shard_slot(self, name: str, slot: WeightSlot) -> WeightSlot:
        return shard_slot(self.config, self.tp, name, slot)

    def holds(self, name: str) -> bool:
        """Whether this pipeline stage loads checkpoint tensor `name` (its layers, and the embedding, final norm
        and head where it has them)."""
        if self.stage.layers is None:
            return True
        if found := LAYER_NAME.match(name):
            return int(found.group(1)) in self.stage.layers
        if name.startswith("model.embed_tokens."):
            return self.model.embed_tokens is not None
        if name.startswith(("model.norm.", "lm_head.")):
            return self.stage.is_last
        return True

    def extra_slots(self) -> dict[str, WeightSlot]:
        """A mixture-of-experts layer's router, experts (stacked) and shared expert, by their checkpoint names."""
        slots: dict[str, WeightSlot] = {}
        naming = self.config.moe.naming if self.config.moe is not None else ""
        for i, layer in enumerate(self.model.layers):
            if isinstance(getattr(layer, "mlp", None), FusedMoE):
                prefix = f"model.layers.{i}"
                for name, s in layer.mlp.checkpoint_slots(prefix, naming).items():
                    slots[name] = replace(s, param=f"{prefix}.mlp.{s.param}")
        return slots
