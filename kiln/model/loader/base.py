"""What every checkpoint loader returns, a file's version, and typed reads of config fields (how a model name becomes
a path: kiln.model.paths)."""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from kiln.config import ModelConfig
from kiln.errors import ModelLoadError


class FileVersion(NamedTuple):
    """Which version of a file a process read: its size and modification time (a rewrite changes one of them).
    Memos of parsed files (GGUF headers, tokenizers, dequantized copies) are keyed on it with the path."""

    size: int
    mtime_ns: int


def file_version(path: str | os.PathLike[str]) -> FileVersion:
    stat = os.stat(path)
    return FileVersion(stat.st_size, stat.st_mtime_ns)


@dataclass(frozen=True)
class CheckpointHeader:
    """What a checkpoint says about itself, read from headers only (no weights)."""

    path: str
    format: str  # "gguf" | "hf"
    config: ModelConfig
    # tensor name (checkpoint's own naming) -> storage type name ("F32", "Q4_1", "BF16", ...)
    tensor_types: dict[str, str] = field(default_factory=dict)
    # tensor name -> shape as the checkpoint stores it
    tensor_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)


def longrope_scaling(
    original: int,
    longest: int,
    short_factor: list[float],
    long_factor: list[float],
    factor: float | None = None,
    attention_factor: float | None = None,
) -> dict:
    """Phi-3's long-rope as `ModelConfig.rope_scaling` (kiln.model.layers.RotaryEmbedding reads it): per-frequency
    factors, the pretraining context `original`, and the cos/sin magnitude `attention_factor`, when not given
    computed as HF's _compute_longrope_parameters does from `factor` (default: the context ratio longest / original)."""
    factor = factor or longest / original
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {
        "rope_type": "longrope",
        "original_max_position_embeddings": original,
        "attention_factor": attention_factor,
        "short_factor": short_factor,
        "long_factor": long_factor,
    }


# HF activation names of gated MLPs -> kiln's (kiln.model.layers.MLP, kiln.model.moe)
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


class ConfigFields:
    """Typed reads of a checkpoint's hyper-parameters (config.json keys, GGUF metadata keys).

    `lookup(key)` gives the stored value, None when the key is absent (a JSON null counts as absent). A missing
    required field or a value of the wrong type is a ModelLoadError that names the file, the field, what was
    expected and what was found. Messages name a field `label` + its key (e.g. "rope_scaling.factor"), or what
    `names` maps the key to: the file's own name for it when keys are read under other names (kiln.model.loader.
    config_view reads GGUF metadata under config.json's names).
    """

    def __init__(
        self, path: str, lookup: Callable[[str], object], label: str = "", names: Mapping[str, str] | None = None
    ) -> None:
        self.path = path
        self.lookup = lookup
        self.label = label
        self.names = names or {}

    def name(self, key: str) -> str:
        """How messages name field `key`."""
        return self.label + self.names.get(key, key)

    def error(self, key: str, problem: str) -> ModelLoadError:
        return ModelLoadError(self.path, f"field {self.name(key)} {problem}")

    def _read(self, key: str, default: object, expected: str) -> object:
        value = self.lookup(key)
        if value is not None:
            return value
        if default is None:
            raise self.error(key, f"is missing (expected {expected})")
        return default

    def positive_int(self, key: str, default: int | None = None) -> int:
        value = self._read(key, default, "a positive integer")
        if not _is_int(value) or value < 1:
            raise self.error(key, f"must be a positive integer, found {value!r}")
        return int(value)

    def token_id(self, key: str) -> int | None:
        """An optional token id (absent: None)."""
        value = self.lookup(key)
        if value is not None and (not _is_int(value) or value < 0):
            raise self.error(key, f"must be a token id (an integer >= 0) or absent, found {value!r}")
        return None if value is None else int(value)

    def token_ids(self, key: str) -> tuple[int, ...]:
        """Token ids given as one id, a list of ids, or absent (no ids)."""
        value = self.lookup(key)
        ids = value if isinstance(value, list) else [] if value is None else [value]
        if not all(_is_int(i) and i >= 0 for i in ids):
            raise self.error(key, f"must be a token id, a list of token ids or absent, found {value!r}")
        return tuple(int(i) for i in ids)

    def positive_float(self, key: str, default: float | None = None) -> float:
        value = self._read(key, default, "a positive number")
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or not value > 0:
            raise self.error(key, f"must be a positive number, found {value!r}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self._read(key, default, "true or false")
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, found {value!r}")
        return value

    def text(self, key: str, default: str | None = None) -> str:
        value = self._read(key, default, "a string")
        if not isinstance(value, str):
            raise self.error(key, f"must be a string, found {value!r}")
        return value

    def activation(self, key: str, default: str) -> str:
        """A gated MLP's activation by its HF name, as kiln names it ("silu" or "gelu_tanh")."""
        name = self.text(key, default)
        if name not in ACTIVATIONS:
            raise self.error(key, f"is {name!r}; kiln runs {', '.join(ACTIVATIONS)}")
        return ACTIVATIONS[name]

    def int_list(self, key: str, length: int) -> tuple[int, ...]:
        """A list of `length` integers >= 0 (absent: empty)."""
        value = self.lookup(key)
        if value is None:
            return ()
        if not isinstance(value, list) or len(value) != length or not all(_is_int(v) and v >= 0 for v in value):
            raise self.error(key, f"must be a list of {length} integers >= 0, found {value!r:.80}")
        return tuple(int(v) for v in value)

    def choices(self, key: str, length: int, allowed: tuple[str, ...]) -> tuple[str, ...]:
        """A list of `length` strings, each one of `allowed` (absent: empty)."""
        value = self.lookup(key)
        if value is None:
            return ()
        if not isinstance(value, list) or len(value) != length or not all(v in allowed for v in value):
            raise self.error(key, f"must be a list of {length} values from {', '.join(allowed)}, found {value!r:.80}")
        return tuple(value)

    def head_dim(self) -> int:
        """`head_dim` when present, else hidden_size / num_attention_heads, which must then divide evenly."""
        hidden_key, heads_key, head_dim_key = "hidden_size", "num_attention_heads", "head_dim"
        hidden, heads = self.positive_int(hidden_key), self.positive_int(heads_key)
        if self.lookup(head_dim_key) is not None:
            return self.positive_int(head_dim_key)
        if hidden % heads:
            raise ModelLoadError(
                self.path,
                f"field {self.name(hidden_key)} ({hidden}) is not divisible by {self.name(heads_key)} ({heads}): "
                f"the head size is {self.name(hidden_key)} / {self.name(heads_key)} when {self.name(head_dim_key)} "
                f"is absent; fix one of them or set {self.name(head_dim_key)}",
            )
        return hidden // heads

    def kv_heads(self, heads_key: str, heads: int, kv_key: str) -> int:
        """Key/value heads (default: one per query head); each must serve a whole group of query heads."""
        kv = self.positive_int(kv_key, default=heads)
        if heads % kv:
            raise ModelLoadError(
                self.path,
                f"field {self.name(heads_key)} ({heads}) is not divisible by {self.name(kv_key)} ({kv}): "
                "every key/value head must serve the same number of query heads",
            )
        return kv


def _is_int(value: object) -> bool:
    # NOTE: bool is an int subclass in Python; `true` is never a valid head count.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
