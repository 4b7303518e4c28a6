"""Which slice of each layer a tensor-parallel rank holds, and what cannot be split (no process group needed)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kiln.config import ModelConfig, MoEConfig
from kiln.distributed.sharding import HeadSpan, TensorParallel
from kiln.errors import ConfigError
from kiln.model.causal_lm import Shard, WeightSlot
from kiln.model.parallel import check_splittable, local_kv_heads
from kiln.model.tp_slots import shard_slot, split_part_rows
from kiln.quant.quantize import quantize


def test_uneven_kv_heads_take_their_query_heads() -> None:
    # SmolLM2-135M: 9 query heads over 3 KV heads (groups of 3), 2 ranks: 2 + 1 KV heads
    assert TensorParallel(0, 2).heads(9, 3) == HeadSpan(0, 6, 0, 2)
    assert TensorParallel(1, 2).heads(9, 3) == HeadSpan(6, 3, 2, 1)


def test_even_split_and_replicated_kv_heads() -> None:
    assert [TensorParallel(r, 4).heads(32, 8) for r in (0, 3)] == [HeadSpan(0, 8, 0, 2), HeadSpan(24, 8, 6, 2)]
    # 2 KV heads over 4 ranks: each replicated on 2 ranks, which split its 4 query heads
    assert [TensorParallel(r, 4).heads(8, 2) for r in range(4)] == [
        HeadSpan(0, 2, 0, 1),
        HeadSpan(2, 2, 0, 1),
        HeadSpan(4, 2, 1, 1),
        HeadSpan(6, 2, 1, 1),
    ]


def test_unsplittable_heads_and_sizes_are_refused() -> None:
    with pytest.raises(ConfigError, match="3 KV heads and 9 query heads"):
        TensorParallel(0, 4).heads(9, 3)
    with pytest.raises(ConfigError, match="does not divide the MLP's intermediate size"):
        TensorParallel(0, 5).span(1536, "the MLP's intermediate size")


def test_vocab_slices_are_padded_to_one_size() -> None:
    assert TensorParallel(0, 2).vocab_span(49152) == (0, 24576, 24576)
    assert TensorParallel(2, 3).vocab_span(10) == (8, 2, 4)  # the last rank's slice is short; its padding stays zero


def smollm_config(**changes: object) -> ModelConfig:
    base = ModelConfig(
        name="t",
        architecture="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=2,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    return replace(base, **changes)


def test_slots_name_the_checkpoint_shape_and_the_shard() -> None:
    config, tp = smollm_config(), TensorParallel(1, 2)
    q = shard_slot(config, tp, "model.layers.0.self_attn.q_proj.weight", WeightSlot("p", 0, (192, 576)))
    assert q.shape == (576, 576) and q.shard == Shard(0, 384, 192)
    o = shard_slot(config, tp, "model.layers.0.self_attn.o_proj.weight", WeightSlot("o", 0, (576, 192)))
    assert o.shape == (576, 576) and o.shard == Shard(1, 384, 192)
    down = shard_slot(config, tp, "model.layers.0.mlp.down_proj.weight", WeightSlot("d", 0, (576, 768)))
    assert down.shape == (576, 1536) and down.shard == Shard(1, 768, 768)
    norm = WeightSlot("n", 0, (576,))
    assert shard_slot(config, tp, "model.layers.0.input_layernorm.weight", norm) is norm
    assert split_part_rows(config, tp, ".qkv_proj.") == (192, 64, 64)


def test_slot_takes_its_rows_or_columns_of_plain_and_packed_tensors() -> None:
    weight = torch.arange(8 * 64, dtype=torch.float32).reshape(8, 64)
    rows = WeightSlot("p", 0, (8, 64), shard=Shard(0, 4, 4))
    cols = WeightSlot("p", 0, (8, 64), shard=Shard(1, 32, 32))
    assert torch.equal(rows.take(weight), weight[4:])
    assert torch.equal(cols.take(weight), weight[:, 32:])
    packed = quantize(weight, "int8", 32)
    assert torch.equal(cols.take(packed).dequantize(), packed.dequantize()[:, 32:])
    assert torch.equal(rows.take(packed).dequantize(), packed.dequantize()[4:])
    with pytest.raises(ValueError, match="groups of 32"):
        packed.narrow(1, 16, 32)
    target = torch.zeros(4, 64)
    assert rows.view(target).shape == (4, 64)


EXPERTS = MoEConfig(num_experts=8, num_experts_per_tok=2, intermediate_size=64, naming="mixtral", norm_topk_prob=True)


def test_models_kiln_cannot_split_fail_before_loading() -> None:
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        check_splittable(smollm_config(moe=EXPERTS), 2)
    with pytest.raises(ConfigError, match="q/k/v fused"):
        check_splittable(smollm_config(fused_checkpoint=True), 2)
    check_splittable(smollm_config(), 2)
    check_splittable(smollm_config(moe=EXPERTS), 1)  # one rank splits nothing


def test_one_process_keeps_every_kv_head() -> None:
    class Whole(torch.nn.Module):
        config = smollm_config()

    assert local_kv_heads(Whole()) == 3
