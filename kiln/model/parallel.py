"""Tensor-parallel pieces of a model's forward (kiln.distributed.sharding says which slice each rank holds): the
all-reduce after a row-parallel layer and the vocab-parallel embedding. With one rank both are the plain forward."""

from __future__ import annotations

import torch
from torch import nn

import kiln.distributed.ops  # noqa: F401  (registers torch.ops.kiln.all_reduce / all_gather)
from kiln.config import ModelConfig, ParallelConfig
from kiln.distributed.sharding import TensorParallel
from kiln.errors import ConfigError
from kiln.model.loader.families import family_of


def reduce_partial(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The full output of a row-parallel layer from this rank's partial product (sum over the ranks)."""
    return torch.ops.kiln.all_reduce(x) if tp.is_split else x


def embed(embedding: nn.Module, input_ids: torch.Tensor, tp: TensorParallel, vocab_size: int) -> torch.Tensor:
    """Rows of a vocab-parallel embedding: each rank looks up the ids in its slice, zeros elsewhere, summed."""
    if not tp.is_split:
        return embedding(input_ids)
    start, rows, _ = tp.vocab_span(vocab_size)
    local = input_ids - start
    inside = (local >= 0) & (local < rows)
    hidden = embedding(torch.where(inside, local, 0))
    return reduce_partial(hidden * inside.unsqueeze(-1).to(hidden.dtype), tp)


def local_kv_heads(model: nn.Module) -> int:
    """The KV heads this rank's cache holds: its share under tensor parallelism, else all of the model's."""
    config = model.config
    tp: TensorParallel = getattr(model, "tp", None) or TensorParallel()
    return tp.heads(config.num_heads, config.num_kv_heads).kv_count


def held_layers(model: nn.Module) -> tuple[int, ...] | None:
    """The decoder layers this pipeline stage runs (None: every layer)."""
    stage = getattr(model, "stage", None)
    return stage.layers if stage is not None else None


def check_splittable(config: ModelConfig, size: int) -> None:
    """ConfigError, before anything loads, if `size` tensor-parallel ranks cannot split this model."""
    if size == 1:
        return
    why = ""
    if config.num_experts:
        why = "kiln's tensor parallelism splits dense MLPs, not mixture-of-experts layers"
    elif config.fused_checkpoint:
        why = "its checkpoint stores q/k/v fused, which kiln does not split per rank"
    if why:
        raise ConfigError(f"{config.architecture} with --tensor-parallel-size {size}: {why}; use size 1")
    for rank in range(size):
        TensorParallel(rank, size).heads(config.num_heads, config.num_kv_heads)
    TensorParallel(0, size).span(config.intermediate_size, "the MLP's intermediate size")


def check_parallel(config: ModelConfig, parallel: ParallelConfig) -> None:
    """ConfigError, before any rank starts, for a split this model cannot take: its family does not split, the
    tensor size does not divide it, or the pipeline has more stages than layers."""
    if not family_of(config.architecture).model_class().splits_across_ranks:
        raise ConfigError(
            f"{config.architecture}: kiln splits the Llama-shaped families across ranks (Llama, Mistral, Qwen2/3); "
            "run this one with --tensor-parallel-size 1 --pipeline-parallel-size 1"
        )
    check_splittable(config, parallel.tensor)
    if parallel.pipeline > config.num_layers:
        raise ConfigError(
            f"--pipeline-parallel-size {parallel.pipeline}: more stages than the model's {config.num_layers} layers"
        )
    if parallel.stage_layers is not None:
        placed = sorted(i for stage in parallel.stage_layers for i in stage)
        if placed != list(range(config.num_layers)) or len(parallel.stage_layers) != parallel.pipeline:
            raise ConfigError(
                f"the placement's {len(parallel.stage_layers)} stages do not place the model's {config.num_layers} "
                "layers once each (validate the recipe against this model: kiln recipe validate R --model M)"
            )
