"""Which part of each checkpoint tensor a tensor-parallel rank of a Llama-shaped model loads (the split itself is
kiln.distributed.sharding's): the rows of q/k/v and gate/up, the columns of o_proj and down_proj, the vocabulary rows
of the embedding and head. Norms (and anything else) are loaded whole on every rank."""

from __future__ import annotations

from dataclasses import replace

from kiln.config import ModelConfig
from kiln.distributed.sharding import TensorParallel
from kiln.model.causal_lm import Shard, WeightSlot


def _spans(config: ModelConfig, tp: TensorParallel) -> dict[str, tuple[int, int, int, int]]:
    """Checkpoint name fragment -> (dim, start, length, full size along dim)."""
    hd = config.head_dim
    heads = tp.heads(config.num_heads, config.num_kv_heads)
    q = (heads.q_start * hd, heads.q_count * hd, config.q_size)
    kv = (heads.kv_start * hd, heads.kv_count * hd, config.kv_size)
    mlp = (*tp.span(config.intermediate_size, "the MLP's intermediate size"), config.intermediate_size)
    vocab_start, vocab_rows, _ = tp.vocab_span(config.vocab_size)
    vocab = (vocab_start, vocab_rows, config.vocab_size)
    return {
        ".q_proj.": (0, *q),
        ".k_proj.": (0, *kv),
        ".v_proj.": (0, *kv),
        ".o_proj.weight": (1, *q),
        ".gate_proj.": (0, *mlp),
        ".up_proj.": (0, *mlp),
        ".down_proj.weight": (1, *mlp),
        "embed_tokens.weight": (0, *vocab),
        "lm_head.weight": (0, *vocab),
    }


def shard_slot(config: ModelConfig, tp: TensorParallel, name: str, slot: WeightSlot) -> WeightSlot:
    """`slot` (shaped like this rank's part) as the checkpoint's full tensor plus the shard this rank takes."""
    if not tp.is_split:
        return slot
    for fragment, (dim, start, length, full) in _spans(config, tp).items():
        if fragment in name:
            shape = list(slot.shape)
            shape[dim] = full
            return replace(slot, shape=tuple(shape), shard=Shard(dim, start, length))
    return slot


def split_part_rows(config: ModelConfig, tp: TensorParallel, fused: str) -> tuple[int, ...]:
    """This rank's rows of each part of a fused qkv_proj or gate_up_proj."""
    if fused == ".qkv_proj.":
        heads = tp.heads(config.num_heads, config.num_kv_heads)
        q, kv = heads.q_count * config.head_dim, heads.kv_count * config.head_dim
        return (q, kv, kv)
    rows = tp.span(config.intermediate_size, "the MLP's intermediate size")[1]
    return (rows, rows)
