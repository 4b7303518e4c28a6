"""Model families: which architectures kiln runs, each one `Family` entry under both of its names, with its model
class, its GGUF layout and its config reader.

An entry is registered by its HF class name (`config.json`'s `architectures`, e.g. "Qwen3ForCausalLM") and, when
kiln reads its GGUF files, llama.cpp's name (`general.architecture`, e.g. "qwen3", in its `gguf` layout). It names
kiln's architecture key (`ModelConfig.architecture`), the model class (a class, or "module:Class" so that reading a
checkpoint header imports no model code), the values HF's class fixes whatever config.json says (`hf_fixed`), and
a config reader: `read(view, config) -> ModelConfig`, the family's own settings read through a `ConfigView` (the
same reader for both formats, kiln.model.loader.config_view) into a copy of the shared `config` (typed, checked,
with the file and field named on error). `kiln.models.register` is the public way in.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kiln.config import ModelConfig
from kiln.env import read_env
from kiln.errors import ConfigError
from kiln.model.loader.config_view import ConfigView
from kiln.model.loader.gguf_layout import (
    GEMMA_NAMES,
    LAYER_NAMES,
    MIXTRAL_EXPERT_NAMES,
    MIXTRAL_NAMES,
    MOE_NAMES,
    PHI3_NAMES,
    QK_NORM_NAMES,
    QWEN_EXPERT_NAMES,
    SHARED_EXPERT_NAMES,
    GGUFLayout,
    gemma2_implied,
    gemma3_implied,
    mistral_implied,
    qwen3_moe_implied,
)

ConfigReader = Callable[[ConfigView, ModelConfig], ModelConfig]


@dataclass(frozen=True)
class Family:
    """One architecture kiln runs, under its HF name (its key in FAMILIES) and its GGUF name (`gguf`)."""

    architecture: str  # kiln's key for it (ModelConfig.architecture)
    model: str | type  # the model class, or "module:Class"
    read_config: str | ConfigReader | None = None  # the family's own settings, or "module:function"
    gguf: GGUFLayout | None = None  # llama.cpp's name and layout of its GGUF files (None: kiln reads none)
    # config.json's names -> values HF's class for the family fixes, whatever the file says
    hf_fixed: Mapping[str, object] = field(default_factory=dict)

    def model_class(self) -> type:
        return _resolve(self.model)

    def reader(self) -> ConfigReader | None:
        return None if self.read_config is None else _resolve(self.read_config)


_LLAMA = "kiln.model.llama:LlamaForCausalLM"
_GEMMA = "kiln.model.gemma:GemmaForCausalLM"
_READ = "kiln.model.family_configs:"
_READ_GEMMA = "kiln.model.gemma_config:"
_BIASED = {"attention_bias": True}  # NOTE: HF's Qwen2 classes always have q/k/v biases; config.json has no key
_QWEN_MOE = GGUFLayout("qwen2moe", MOE_NAMES | SHARED_EXPERT_NAMES, experts=QWEN_EXPERT_NAMES)
_MIXTRAL = GGUFLayout("llama", MIXTRAL_NAMES, permuted_qk=True, experts=MIXTRAL_EXPERT_NAMES, with_experts=True)
# HF architecture name -> family; `register` adds to it
FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family("llama", _LLAMA, gguf=GGUFLayout("llama", permuted_qk=True)),
    "MistralForCausalLM": Family(
        "mistral",
        _LLAMA,
        read_config=_READ + "read_mistral",
        gguf=GGUFLayout("mistral", implied=mistral_implied, permuted_qk=True),
    ),
    "Qwen2ForCausalLM": Family(
        "qwen2", _LLAMA, read_config=_READ + "read_qwen2", gguf=GGUFLayout("qwen2"), hf_fixed=_BIASED
    ),
    "Qwen3ForCausalLM": Family(
        "qwen3", _LLAMA, read_config=_READ + "read_qwen3", gguf=GGUFLayout("qwen3", LAYER_NAMES | QK_NORM_NAMES)
    ),
    "Phi3ForCausalLM": Family(
        "phi3", _LLAMA, read_config=_READ + "read_phi3", gguf=GGUFLayout("phi3", PHI3_NAMES, long_rope=True)
    ),
    "MixtralForCausalLM": Family("mixtral", _LLAMA, read_config=_READ + "read_mixtral", gguf=_MIXTRAL),
    "Qwen2MoeForCausalLM": Family(
        "qwen2_moe", _LLAMA, read_config=_READ + "read_qwen2_moe", gguf=_QWEN_MOE, hf_fixed=_BIASED
    ),
    "Qwen3MoeForCausalLM": Family(
        "qwen3_moe",
        _LLAMA,
        read_config=_READ + "read_qwen3_moe",
        gguf=GGUFLayout("qwen3moe", MOE_NAMES | QK_NORM_NAMES, qwen3_moe_implied, experts=QWEN_EXPERT_NAMES),
    ),
    "Gemma2ForCausalLM": Family(
        "gemma2",
        _GEMMA,
        read_config=_READ_GEMMA + "read_gemma2",
        gguf=GGUFLayout("gemma2", GEMMA_NAMES, gemma2_implied, norm_plus_one=True),
    ),
    "Gemma3ForCausalLM": Family(
        "gemma3",
        _GEMMA,
        read_config=_READ_GEMMA + "read_gemma3",
        gguf=GGUFLayout("gemma3", GEMMA_NAMES | QK_NORM_NAMES, gemma3_implied, norm_plus_one=True),
    ),
}


def register(
    hf_architecture: str,
    model_class: type | str,
    *,
    architecture: str | None = None,
    read_config: ConfigReader | str | None = None,
) -> Family:
    """Run checkpoints whose config.json names `hf_architecture` with `model_class` (see kiln.models)."""
    if not isinstance(hf_architecture, str) or not hf_architecture:
        raise ConfigError(f"register: the HF architecture name must be a non-empty string, got {hf_architecture!r}")
    family = Family(architecture or hf_architecture, model_class, read_config=read_config)
    taken = {f.architecture: name for name, f in FAMILIES.items() if name != hf_architecture}
    owner = taken.get(family.architecture)
    if owner is not None and FAMILIES[owner].model != model_class:
        raise ConfigError(f"register {hf_architecture}: architecture key {family.architecture!r} is {owner}'s")
    FAMILIES[hf_architecture] = family
    return family


PLUGIN_ENV = "KILN_MODEL_PLUGINS"  # comma list of modules that call kiln.models.register when imported (kiln.env)
ENTRY_POINT_GROUP = "kiln.models"  # or a package's entry points: each loaded (a module, or a function called)
_plugins_loaded = False


def load_plugins() -> None:
    """Import the model plugins named by KILN_MODEL_PLUGINS and the `kiln.models` entry points, once per process."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for name in read_env().model_plugins:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a broken plugin is a clear error, not a traceback from deep in the loader
            raise ConfigError(
                f"{PLUGIN_ENV}: cannot import model plugin {name!r} ({type(exc).__name__}: {exc})"
            ) from exc
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            loaded = entry.load()
        except Exception as exc:
            raise ConfigError(f"entry point {entry.name} = {entry.value} ({ENTRY_POINT_GROUP}): {exc}") from exc
        if callable(loaded) and not isinstance(loaded, type):
            loaded()


def find(hf_architectures: list[object]) -> Family | None:
    """The family of the first registered name in config.json's `architectures` (plugins loaded when needed)."""
    for attempt in range(2):
        found = next((FAMILIES[a] for a in hf_architectures if isinstance(a, str) and a in FAMILIES), None)
        if found is not None or attempt:
            return found
        load_plugins()
    return None


def family_of(architecture: str) -> Family:
    """The family registered under kiln architecture key `architecture`."""
    for family in FAMILIES.values():
        if family.architecture == architecture:
            return family
    raise ConfigError(f"no model family {architecture!r} is registered: kiln runs {', '.join(architectures())}")


def gguf_family(gguf_architecture: str, has_experts: bool) -> tuple[Family, GGUFLayout] | None:
    """The family of a GGUF file of llama.cpp architecture `gguf_architecture` (its `general.architecture`), with
    experts (`{arch}.expert_count` > 0) or not, and its layout; None when kiln reads no such files."""
    found = [(f, f.gguf) for f in FAMILIES.values() if f.gguf is not None and f.gguf.architecture == gguf_architecture]
    # NOTE: llama.cpp builds dense MLPs when expert_count is 0 or absent (the variant's reader checks its type)
    variant = next((pair for pair in found if pair[1].with_experts), None)
    if variant is not None and has_experts:
        return variant
    return next((pair for pair in found if not pair[1].with_experts), None)


def gguf_architectures() -> list[str]:
    """llama.cpp's names of the architectures kiln reads GGUF files of."""
    return sorted({f.gguf.architecture for f in FAMILIES.values() if f.gguf is not None})


def gguf_layout(architecture: str) -> GGUFLayout:
    """The GGUF layout of kiln family `architecture` (ModelConfig.architecture; Llama's for a family GGUF lacks)."""
    layouts = {f.architecture: f.gguf for f in FAMILIES.values() if f.gguf is not None}
    return layouts.get(architecture) or layouts["llama"]


def architectures() -> list[str]:
    return sorted({f.architecture for f in FAMILIES.values()})


def _resolve(target: Any) -> Any:
    if not isinstance(target, str):
        return target
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)
