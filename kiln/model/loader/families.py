"""Model families: which HF architecture names kiln runs, with which model class and which config reader.

A family is registered by its HF class name (`config.json`'s `architectures`, e.g. "Qwen3ForCausalLM"). Its
entry names kiln's architecture key (`ModelConfig.architecture`), the model class (a class, or "module:Class" so
that reading a checkpoint header imports no model code), and a config reader: a function of the config's
`ConfigFields` returning the `ModelConfig` fields the family sets beyond the shared ones (typed, checked, with the
file and field named on error). `kiln.models.register` is the public way in.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kiln.env import read_env
from kiln.errors import ConfigError
from kiln.model.loader.base import ConfigFields

ConfigReader = Callable[[ConfigFields], dict[str, Any]]


@dataclass(frozen=True)
class Family:
    architecture: str  # kiln's key for it (ModelConfig.architecture)
    model: str | type  # the model class, or "module:Class"
    read_config: str | ConfigReader | None = None  # the family's own config fields, or "module:function"

    def model_class(self) -> type:
        return _resolve(self.model)

    def reader(self) -> ConfigReader | None:
        return None if self.read_config is None else _resolve(self.read_config)


_LLAMA = "kiln.model.llama:LlamaForCausalLM"
_READ = "kiln.model.family_configs:"
# HF architecture name -> family; `register` adds to it
FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family("llama", _LLAMA),
    "MistralForCausalLM": Family("mistral", _LLAMA, _READ + "read_mistral"),
    "Qwen2ForCausalLM": Family("qwen2", _LLAMA, _READ + "read_qwen2"),
    "Qwen3ForCausalLM": Family("qwen3", _LLAMA, _READ + "read_qwen3"),
    "Phi3ForCausalLM": Family("phi3", _LLAMA, _READ + "read_phi3"),
    "MixtralForCausalLM": Family("mixtral", _LLAMA, _READ + "read_mixtral"),
    "Qwen2MoeForCausalLM": Family("qwen2_moe", _LLAMA, _READ + "read_qwen2_moe"),
    "Qwen3MoeForCausalLM": Family("qwen3_moe", _LLAMA, _READ + "read_qwen3_moe"),
    "Gemma2ForCausalLM": Family("gemma2", "kiln.model.gemma:GemmaForCausalLM", "kiln.model.gemma:read_gemma2"),
    "Gemma3ForCausalLM": Family("gemma3", "kiln.model.gemma:GemmaForCausalLM", "kiln.model.gemma:read_gemma3"),
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
    family = Family(architecture or hf_architecture, model_class, read_config)
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


def architectures() -> list[str]:
    return sorted({f.architecture for f in FAMILIES.values()})


def _resolve(target: Any) -> Any:
    if not isinstance(target, str):
        return target
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)
