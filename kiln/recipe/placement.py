"""The load report of a placement: what each pipeline stage (and each device of it) holds, computed from the
checkpoint's tensor shapes, so a split can be judged before any device is touched.

What is counted, and how:
- Weights at run time: every checkpoint tensor in weights.dtype; under int8/int4 the 2-D weights inside decoder
  layers (the linear layers) at their code width plus one weights.dtype scale per group, as the memory check
  counts them. The embedding and head stay at weights.dtype (an over-count where packed GGUF blocks keep them
  narrower).
- A decoder layer's tensors go to its stage; the embedding and any other tensor outside the layers (rope_freqs)
  to the first stage; the final norm and lm_head to the last. Each checkpoint tensor is counted once, so the
  stages' weight bytes add up to the checkpoint's. A tied head is that once-counted embedding; with more than one
  stage the last also holds it as its head, reported apart as `head_copy_bytes`.
- Per device of a stage: the stage's bytes divided by parallel.tensor (the even share: norms are replicated and
  an uneven head split puts a little more on the first ranks). KV: the ranks' largest share of KV heads.

Balance rule: the stages' held weight bytes (their tensors plus a head copy) may differ by at most
BALANCE_LIMIT (largest / smallest); beyond that a warning names both. KV grows with the layers and is reported
beside the weights, not weighed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kiln.config import ModelConfig
from kiln.distributed.sharding import even_stage_layers
from kiln.errors import ConfigError
from kiln.model.dtypes import parse_dtype
from kiln.model.kv_format import kv_storage_dtype
from kiln.recipe.checkpoint import read_header
from kiln.recipe.recipe import Recipe
from kiln.recipe.schema import RecipeSpec
from kiln.recipe.stages import StageLayers

BALANCE_LIMIT = 1.25
KV_UNIT_TOKENS = 1000  # KV is reported per this many tokens when there is no KV plan
LAYER = re.compile(r"(?:model\.layers|blk)\.(\d+)\.")  # HF and GGUF spellings of a decoder layer's tensors
EMBEDDING = ("model.embed_tokens.weight", "token_embd.weight")
LAST_STAGE = ("model.norm.weight", "output_norm.weight", "lm_head.weight", "output.weight")
CODE_BITS = {"int8": 8, "int4": 4}


@dataclass(frozen=True)
class StageLoad:
    """One pipeline stage: its layers, the checkpoint bytes placed on it, and its KV cache."""

    device_id: int
    layers: tuple[int, ...]
    weight_bytes: int  # the checkpoint tensors placed here, each counted once over all stages
    head_copy_bytes: int  # the last stage's copy of a tied embedding as its head (0 otherwise)
    kv_bytes: int  # the stage's KV cache for Placement.kv_tokens tokens (all its ranks)
    kv_bytes_per_device: int  # the rank with the most KV heads
    tensor: int

    @property
    def held_bytes(self) -> int:
        return self.weight_bytes + self.head_copy_bytes

    @property
    def weight_bytes_per_device(self) -> int:
        return -(-self.held_bytes // self.tensor)


@dataclass(frozen=True)
class Placement:
    """Every stage's load. `kv_tokens` None: KV is per KV_UNIT_TOKENS tokens (no KV plan was given)."""

    stages: tuple[StageLoad, ...]
    tensor: int
    kv_tokens: int | None
    total_weight_bytes: int  # the checkpoint's tensors at run time, each once
    other_tensors: tuple[str, ...]  # outside the layers, not embedding/norm/head: counted on the first stage
    tied_head: bool  # the head is the embedding (no lm_head tensor of its own)

    @property
    def pipeline(self) -> int:
        return len(self.stages)

    @property
    def world_size(self) -> int:
        return self.pipeline * self.tensor

    @property
    def imbalance(self) -> float:
        """Largest stage's held weight bytes over the smallest's (1.0 for one stage)."""
        held = [s.held_bytes for s in self.stages]
        return max(held) / max(min(held), 1)

    @property
    def warning(self) -> str | None:
        """Why the placement is unbalanced (BALANCE_LIMIT), with the numbers; None when it is not."""
        if self.imbalance <= BALANCE_LIMIT:
            return None
        big = max(self.stages, key=lambda s: s.held_bytes)
        small = min(self.stages, key=lambda s: s.held_bytes)
        return (
            f"unbalanced placement: device {big.device_id} holds {format_bytes(big.held_bytes)} of weights "
            f"({len(big.layers)} layers), device {small.device_id} {format_bytes(small.held_bytes)} "
            f"({len(small.layers)} layers): {self.imbalance:.2f}x, above {BALANCE_LIMIT}x; the slowest stage sets "
            f"the pace, so move layers from device {big.device_id} toward device {small.device_id}"
        )


def plan_placement(
    tensor_bytes: Mapping[str, int],
    config: ModelConfig,
    stage_layers: StageLayers,
    tensor: int = 1,
    kv_dtype: torch.dtype = torch.float32,
    kv_tokens: int | None = None,
) -> Placement:
    """The load of each stage of `stage_layers` (in device_id order), from each tensor's run-time bytes (keyed by
    HF or GGUF name; see weight_bytes_of) and the model's KV shape."""
    stage_of = {layer: s for s, layers in enumerate(stage_layers) for layer in layers}
    if sorted(stage_of) != list(range(config.num_layers)) or len(stage_of) != sum(map(len, stage_layers)):
        raise ConfigError(
            f"stage layers {[list(s) for s in stage_layers]} do not place each of the model's "
            f"{config.num_layers} decoder layers exactly once"
        )
    last = len(stage_layers) - 1
    placed = [0] * len(stage_layers)
    other = []
    for name, size in tensor_bytes.items():
        match = LAYER.match(name)
        if match is not None:
            placed[stage_of[int(match.group(1))]] += size
        elif name in LAST_STAGE:
            placed[last] += size
        else:
            placed[0] += size
            if name not in EMBEDDING:
                other.append(name)
    embedding = next((tensor_bytes[n] for n in EMBEDDING if n in tensor_bytes), 0)
    head_copy = embedding if config.tie_word_embeddings and last > 0 else 0
    tokens = kv_tokens if kv_tokens is not None else KV_UNIT_TOKENS
    per_layer = config.kv_bytes_per_token(kv_dtype) // config.num_layers * tokens
    rank_heads = max(1, -(-config.num_kv_heads // tensor))
    stages = tuple(
        StageLoad(
            device_id=s,
            layers=tuple(layers),
            weight_bytes=placed[s],
            head_copy_bytes=head_copy if s == last else 0,
            kv_bytes=per_layer * len(layers),
            kv_bytes_per_device=per_layer * len(layers) * rank_heads // config.num_kv_heads,
            tensor=tensor,
        )
        for s, layers in enumerate(stage_layers)
    )
    total = sum(tensor_bytes.values())
    return Placement(
        stages,
        tensor,
        kv_tokens=kv_tokens,
        total_weight_bytes=total,
        other_tensors=tuple(sorted(other)),
        tied_head=config.tie_word_embeddings,
    )


def weight_bytes_of(shapes: Mapping[str, tuple[int, ...]], spec: RecipeSpec) -> dict[str, int]:
    """Each tensor's bytes at run time under the recipe's weights and quantization (module docstring)."""
    itemsize = parse_dtype(spec.weights.dtype).itemsize
    bits = CODE_BITS.get(spec.quantization.weights)
    group = spec.quantization.group_size
    out = {}
    for name, shape in shapes.items():
        count = math.prod(shape)
        linear = bits is not None and len(shape) == 2 and LAYER.match(name) is not None
        out[name] = count * bits // 8 + count // group * itemsize if linear else count * itemsize
    return out


def recipe_placement(recipe: Recipe) -> Placement:
    """The placement a validated recipe asks for, on the checkpoint it was checked against; KV for its KV plan
    (max_pages x block_size tokens, what the engine allocates per stage)."""
    header = read_header(recipe.model_path)
    config = header.config
    stages = recipe.stage_layers or even_stage_layers(config.num_layers, recipe.pipeline_parallel)
    return plan_placement(
        weight_bytes_of(header.tensor_shapes, recipe.spec),
        config,
        stages,
        tensor=recipe.tensor_parallel,
        kv_dtype=kv_storage_dtype(recipe.kv_cache_dtype, parse_dtype(recipe.dtype)),
        kv_tokens=recipe.max_pages * recipe.block_size,
    )


def format_bytes(size: float) -> str:
    """1e9 bytes and up as GB, else MB (1 GB = 1e9 bytes, as the memory budget counts)."""
    return f"{size / 1e9:.2f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"
