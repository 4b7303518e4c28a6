"""Bring your own architecture: register a model class for an HF architecture name, built from kiln's layers.

    from kiln import models

    class MyForCausalLM(models.CausalLM):
        def __init__(self, config, max_positions, freq_factors=None): ...   # build self.model and self.lm_head
        def forward(self, input_ids, positions): ...                       # -> hidden [num_tokens, hidden]

    models.register("MyForCausalLM", MyForCausalLM, read_config=my_reader)

A checkpoint directory whose config.json lists "MyForCausalLM" in `architectures` then loads with `LLM(path)`,
`kiln serve`, `kiln compile`, `kiln debug` and `kiln recipe validate`, in eager and every graph mode.

The contract (docs/bring-up.md walks through one):
- attention goes through `attend(q, k, v, layer_idx, window=0, softcap=0.0)`: the paged KV cache, the piecewise
  split point, and the traced attention of full decode graphs; nothing else in the forward may read the step's
  metadata, so the forward stays one graph with no host-side branching on values;
- weights load by checkpoint name into `named_parameters()` (`CausalLM.load_weights`); stack several
  checkpoint tensors into one parameter with `fused_parts` / `part_rows`, or map any other way with
  `extra_slots`; every parameter must be filled exactly once, and a checkpoint tensor with no slot is an error;
- `read_config(view, config)` reads the family's own config.json fields through `view` (a `ConfigView`: typed
  reads, so a bad value is an error naming the file and the field) and returns `config` with them:
  `dataclasses.replace(config, own=MySettings(...))`, a frozen dataclass of the family's, for what `ModelConfig`
  has no field for.
"""

from __future__ import annotations

from kiln.config import ModelConfig
from kiln.model.causal_lm import CausalLM, WeightSlot
from kiln.model.graph_attention import attend
from kiln.model.layers import MLP, RMSNorm, RotaryEmbedding
from kiln.model.loader.base import ConfigFields
from kiln.model.loader.config_view import ConfigView
from kiln.model.loader.families import FAMILIES, Family, architectures, register
from kiln.model.moe import FusedMoE

__all__ = [
    "FAMILIES",
    "MLP",
    "CausalLM",
    "ConfigFields",
    "ConfigView",
    "Family",
    "FusedMoE",
    "ModelConfig",
    "RMSNorm",
    "RotaryEmbedding",
    "WeightSlot",
    "architectures",
    "attend",
    "register",
]
