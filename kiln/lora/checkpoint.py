"""Reading a PEFT LoRA checkpoint: `adapter_config.json` + `adapter_model.safetensors` -> `LoRAAdapter`.

Read with json and safetensors (PEFT itself is not needed). What is read: `r`, `lora_alpha`, `use_rslora`,
`rank_pattern` / `alpha_pattern` (per-layer ranks and alphas, matched as PEFT matches them) and each layer's
`lora_A` [rank, in] and `lora_B` [out, rank]. Each layer's scale is alpha / rank (rsLoRA: alpha / sqrt(rank)).
Anything kiln would run wrongly (DoRA, trained biases, extra trained modules) is refused, as is a malformed file:
every error is an AdapterError naming the file and the field. Whether the adapter fits a model is
kiln.lora.validate's.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from kiln.errors import AdapterError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PEFT's wrapper around the HF model, in front of every tensor name
# config fields that change what a layer computes beyond plain LoRA, and the value that means "off"
UNSUPPORTED: dict[str, tuple[object, str]] = {
    "use_dora": (False, "DoRA (weight-decomposed LoRA) is not supported"),
    "bias": ("none", "trained biases are not supported (train with bias='none')"),
    "lora_bias": (False, "a trained lora_B bias is not supported"),
    "modules_to_save": (None, "fully trained extra modules are not supported"),
    "target_parameters": (None, "adapters on parameters (not linear layers) are not supported"),
    "trainable_token_indices": (None, "trained token embeddings are not supported"),
    "layer_replication": (None, "layer replication is not supported"),
}


@dataclass(frozen=True)
class LoRALayer:
    """One adapted linear layer: out += scale * b @ (a @ x)."""

    a: torch.Tensor  # [rank, in]
    b: torch.Tensor  # [out, rank]
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class LoRAAdapter:
    """A PEFT adapter as read from `path`: its layers by HF module name (`model.layers.0.self_attn.q_proj`)."""

    path: str
    layers: dict[str, LoRALayer]
    target_modules: tuple[str, ...] | str | None  # the config's (a list of names, a regex, or none)
    # tensors that are no LoRA layer's (PEFT saves an adapted embedding's or head's base weights): kiln.lora.validate
    # refuses them once the targets are checked, so the message names the cause
    other_tensors: tuple[str, ...] = ()

    @property
    def config_file(self) -> str:
        return str(Path(self.path) / ADAPTER_CONFIG)

    @property
    def weights_file(self) -> str:
        return str(Path(self.path) / ADAPTER_WEIGHTS)

    @property
    def rank(self) -> int:
        return max((layer.rank for layer in self.layers.values()), default=0)


def read_adapter(path: str | Path) -> LoRAAdapter:
    """The adapter in directory `path`; AdapterError naming the file and field for anything missing or wrong."""
    directory = Path(path)
    config_file, weights_file = directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS
    config = _read_config(config_file)
    tensors = _read_tensors(weights_file)
    pairs, others = _pair_tensors(str(weights_file), tensors)
    layers = {}
    for module, (a, b) in pairs.items():
        rank, alpha = _rank_and_alpha(str(config_file), config, module)
        if a.shape[0] != rank:
            a_name = f"{PEFT_PREFIX}{module}.lora_A.weight"
            raise AdapterError(
                str(weights_file), a_name, f"rank {a.shape[0]}, but {ADAPTER_CONFIG} gives this layer rank {rank}"
            )
        scale = alpha / math.sqrt(rank) if config.get("use_rslora", False) else alpha / rank
        layers[module] = LoRALayer(a=a, b=b, scale=scale)
    targets = config.get("target_modules")
    targets = tuple(targets) if isinstance(targets, list) else targets
    return LoRAAdapter(str(directory), layers, targets, others)


def _read_config(config_file: Path) -> dict[str, Any]:
    where = str(config_file)
    try:
        config = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise AdapterError(where, "file", "missing: a PEFT adapter directory holds adapter_config.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(where, "file", f"cannot be read as JSON ({exc})") from None
    if not isinstance(config, dict):
        raise AdapterError(where, "file", f"expected a JSON object, found {type(config).__name__}")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(where, "peft_type", f"{config['peft_type']!r}: kiln runs LoRA adapters (LORA)")
    _check_positive(where, "r", config.get("r"), int)
    _check_positive(where, "lora_alpha", config.get("lora_alpha", config.get("r")), (int, float))
    if not isinstance(config.get("use_rslora", False), bool):
        raise AdapterError(where, "use_rslora", f"{config['use_rslora']!r}: expected true or false")
    for field in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(field) or {}, dict):
            raise AdapterError(where, field, f"{config[field]!r}: expected an object of layer patterns")
    targets = config.get("target_modules")
    is_list = isinstance(targets, list) and all(isinstance(t, str) for t in targets)
    if targets is not None and not isinstance(targets, str) and not is_list:
        raise AdapterError(where, "target_modules", f"{targets!r}: expected a list of module names or a regex")
    for field, (off, why) in UNSUPPORTED.items():
        value = config.get(field, off)
        if value != off and value not in (None, False, [], {}):
            raise AdapterError(where, field, f"{value!r}: {why}")
    return config


def _check_positive(where: str, field: str, value: object, kind: type | tuple[type, ...]) -> None:
    if not isinstance(value, kind) or isinstance(value, bool) or value <= 0:
        raise AdapterError(where, field, f"{value!r}: expected a positive number")


def _read_tensors(weights_file: Path) -> dict[str, torch.Tensor]:
    where = str(weights_file)
    if not weights_file.is_file():
        raise AdapterError(where, "file", "missing: a PEFT adapter directory holds adapter_model.safetensors")
    try:
        return load_file(weights_file)
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(where, "file", f"not a readable safetensors file ({exc})") from None


LORA_NAME = re.compile(r"(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight")


def _pair_tensors(
    where: str, tensors: dict[str, torch.Tensor]
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], tuple[str, ...]]:
    """(HF module name -> (lora_A, lora_B) as fp32, the names of tensors no LoRA layer's); every LoRA tensor must be
    one of a pair."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    others = []
    for name, tensor in tensors.items():
        matched = LORA_NAME.fullmatch(name.removeprefix(PEFT_PREFIX))
        if matched is None:
            others.append(name)
            continue
        if tensor.dim() != 2:
            raise AdapterError(where, name, f"shape {tuple(tensor.shape)}: expected a matrix")
        found.setdefault(matched["module"], {})[matched["which"]] = tensor.float()
    if not found and not others:
        raise AdapterError(where, "tensors", "the file holds no LoRA tensors")
    pairs = {}
    for module, pair in found.items():
        for which, other in (("A", "B"), ("B", "A")):
            if which not in pair:
                missing = f"{PEFT_PREFIX}{module}.lora_{which}.weight"
                raise AdapterError(where, missing, f"missing (its lora_{other} is in the file)")
        a, b = pair["A"], pair["B"]
        if b.shape[1] != a.shape[0]:
            name = f"{PEFT_PREFIX}{module}.lora_B.weight"
            raise AdapterError(where, name, f"shape {tuple(b.shape)}: expected {a.shape[0]} columns (lora_A's rank)")
        pairs[module] = (a, b)
    return pairs, tuple(others)


def _rank_and_alpha(where: str, config: dict[str, Any], module: str) -> tuple[int, float]:
    """The layer's rank and alpha: `rank_pattern` / `alpha_pattern` where a key matches it (as PEFT matches: the
    key is a regex over the end of the module name), else `r` / `lora_alpha`."""
    rank = _pattern_value(where, config, field="rank_pattern", module=module, default=config["r"])
    alpha = config.get("lora_alpha", config["r"])
    alpha = _pattern_value(where, config, field="alpha_pattern", module=module, default=alpha)
    return int(rank), float(alpha)


def _pattern_value(where: str, config: dict[str, Any], *, field: str, module: str, default: int | float) -> int | float:
    for key, value in (config.get(field) or {}).items():
        try:
            matched = re.match(rf"(.*\.)?({key})$", module)
        except re.error as exc:
            raise AdapterError(where, f"{field}[{key!r}]", f"not a regular expression ({exc})") from None
        if matched:
            _check_positive(where, f"{field}[{key!r}]", value, int if field == "rank_pattern" else (int, float))
            return value
    return default
