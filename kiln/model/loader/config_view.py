"""A checkpoint's hyper-parameters under config.json's names, whichever file holds them: the view the one config
reader (kiln.model.loader.config_reader) and every family's reader read through, so that no reader knows the format.

A `ConfigView` is `ConfigFields` (typed reads, errors naming the file and the field) plus the two readings the
formats spell differently: `rope` (GGUF keeps some of its scaling in tensors) and `rope_by_layer_kind` (Gemma 3).
- `HFConfigView`: config.json itself, except what HF's class for the family fixes whatever the file says
  (`Family.hf_fixed`, e.g. Qwen2's q/k/v biases).
- `GGUFConfigView`: `{arch}.*` metadata under config.json's names (`GGUF_KEYS`; messages name the file's own key),
  what the file's tensors say (a tied head, q/k/v biases), and what llama.cpp's converter leaves out of a family's
  files or fixes (`GGUFLayout.implied`, kiln.model.loader.gguf_layout).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from pathlib import Path

from gguf import ReaderTensor

from kiln.model.loader.base import ConfigFields
from kiln.model.loader.gguf_layout import GGUFLayout
from kiln.model.loader.gguf_rope import read_rope_scaling
from kiln.model.loader.hf_rope import hf_rope, hf_rope_by_layer_kind

# config.json's name -> the GGUF metadata key under `{arch}.` that holds the same setting
GGUF_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_hidden_layers": "block_count",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base",
    "max_position_embeddings": "context_length",
    "sliding_window": "attention.sliding_window",
    "num_experts": "expert_count",
    "num_local_experts": "expert_count",  # Mixtral's name for it
    "num_experts_per_tok": "expert_used_count",
    "moe_intermediate_size": "expert_feed_forward_length",
    "shared_expert_intermediate_size": "expert_shared_feed_forward_length",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
}
# config.json's name -> a GGUF key outside `{arch}.`
GGUF_GLOBAL_KEYS = {
    "bos_token_id": "tokenizer.ggml.bos_token_id",
    "eos_token_id": "tokenizer.ggml.eos_token_id",
    "_name_or_path": "general.name",
}


class ConfigView(ConfigFields, ABC):
    """Typed reads by config.json's names (see the module docstring); `default_name` names a model whose file
    does not."""

    default_name: str

    @abstractmethod
    def rope(self, default_theta: float = 10000.0) -> tuple[float, dict | None]:
        """(rope_theta, the `ModelConfig.rope_scaling` dict or None for plain RoPE)."""

    @abstractmethod
    def rope_by_layer_kind(self, default_theta: float, default_local: float) -> tuple[float, dict | None, float]:
        """(the global layers' rope_theta, their scaling or None, the sliding layers' unscaled base): Gemma 3."""


class HFConfigView(ConfigView):
    """config.json (`config`, read from `path`); `fixed`: values HF's class for the family fixes."""

    def __init__(self, path: Path, config: Mapping[str, object], fixed: Mapping[str, object]) -> None:
        super().__init__(str(path), lambda key: fixed[key] if key in fixed else config.get(key))
        self.default_name = path.parent.name

    def rope(self, default_theta: float = 10000.0) -> tuple[float, dict | None]:
        return hf_rope(self, default_theta)

    def rope_by_layer_kind(self, default_theta: float, default_local: float) -> tuple[float, dict | None, float]:
        return hf_rope_by_layer_kind(self, default_theta, default_local)


class GGUFConfigView(ConfigView):
    """The metadata (`field(key)`) and tensors of the GGUF file `path` of llama.cpp architecture `arch`, laid out
    as `layout` says; `num_tokens`: the length of its token list (None: it has none)."""

    def __init__(
        self,
        path: str,
        arch: str,
        field: Callable[[str], object],
        tensors: dict[str, ReaderTensor],
        layout: GGUFLayout,
        num_tokens: int | None,
    ) -> None:
        names = {key: f"{arch}.{gguf}" for key, gguf in GGUF_KEYS.items()} | GGUF_GLOBAL_KEYS
        super().__init__(path, self._lookup, names=names)
        self.arch, self.field, self.tensors, self.layout = arch, field, tensors, layout
        self.default_name = os.path.basename(path)
        self.stated_by_tensors: dict[str, object] = {
            "tie_word_embeddings": "output.weight" not in tensors,
            "attention_bias": "blk.0.attn_q.bias" in tensors,
        }
        # NOTE: a file without `{arch}.vocab_size` has as many tokens as its token list
        self.fallbacks: dict[str, object] = {"vocab_size": num_tokens}
        stored = ConfigFields(path, self._stored, names=names)
        self.implied = layout.implied(stored) if layout.implied is not None else {}

    def _stored(self, key: str) -> object:
        """What the file itself says about config.json's `key` (its metadata, its tensors), None when nothing."""
        if key in self.stated_by_tensors:
            return self.stated_by_tensors[key]
        gguf = f"{self.arch}.{GGUF_KEYS[key]}" if key in GGUF_KEYS else GGUF_GLOBAL_KEYS.get(key)
        value = None if gguf is None else self.field(gguf)
        return self.fallbacks.get(key) if value is None else value

    def _lookup(self, key: str) -> object:
        return self.implied[key] if key in self.implied else self._stored(key)

    def rope(self, default_theta: float = 10000.0) -> tuple[float, dict | None]:
        raw = ConfigFields(self.path, self.field)  # NOTE: the scaling keys are read under the file's own names
        head_dim = self.head_dim()
        longest = self.positive_int("max_position_embeddings", 2048)
        scaling = read_rope_scaling(
            raw, self.arch, tensors=self.tensors, head_dim=head_dim, longest=longest, long_rope=self.layout.long_rope
        )
        return self.positive_float("rope_theta", default_theta), scaling

    def rope_by_layer_kind(self, default_theta: float, default_local: float) -> tuple[float, dict | None, float]:
        theta, scaling = self.rope(default_theta)
        return theta, scaling, self.positive_float("rope_local_base_freq", default_local)
