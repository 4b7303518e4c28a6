"""compressed-tensors checkpoints (the format llm-compressor writes and vLLM reads) -> kiln's forms, through the
`compressed-tensors` package: its `QuantizationConfig` reads `quantization_config`, its matcher says which scheme
a layer has, its unpacking reads `pack-quantized` codes and its compressors decompress what kiln does not pack.

| format            | weights                                  | kiln runs                                     |
|-------------------|------------------------------------------|-----------------------------------------------|
| `pack-quantized`  | int 2-8 bits, group or channel, zero pts | packed codes (4-bit nibbles, wider int8)      |
| `int-quantized`   | int8 (W8A8), channel or group            | packed int8 codes; activations stay float     |
| `naive-quantized` | int8 stored as int8                      | packed int8 codes                             |
| `float-quantized` | FP8 e4m3: tensor, channel, block scales  | dequantized to the model dtype at load        |
| other formats     | nvfp4, mxfp4, ...                        | dequantized by the package's compressor       |

Importing this module imports compressed-tensors (and transformers, seconds): kiln.model.loader.hf_quant imports
it only for a compressed-tensors checkpoint. Every layer's local tensors (`weight_packed`, `weight_scale`,
`weight_zero_point`, `weight_shape`, `weight` ...) arrive together in one dict, as the package's per-module
`decompress` takes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
from compressed_tensors.utils.match import is_match
from pydantic import ValidationError

from kiln.quant.codes import integer_form, ordered_form
from kiln.quant.linear import PackedTensor

INTEGER_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
# NOTE: schemes target module classes ("Linear") or names; every layer kiln reads quantized is a linear layer
_LINEAR = torch.nn.Linear(1, 1, device="meta")


@dataclass(frozen=True)
class LayerScheme:
    """How one layer is stored: its scheme (weights' bits, strategy, group ...) and its compression format."""

    scheme: QuantizationScheme
    format: str

    @property
    def packs(self) -> bool:
        """Whether kiln keeps this layer's integer codes (else it dequantizes them at load)."""
        w = self.scheme.weights
        return self.format in INTEGER_FORMATS and w is not None and w.type == "int" and 2 <= w.num_bits <= 8

    @property
    def bits(self) -> int:
        return self.scheme.weights.num_bits

    def describe(self) -> str:
        w = self.scheme.weights
        kind = f"{w.type}{w.num_bits}"
        how = f"group {w.group_size}" if w.strategy == "group" else str(w.strategy)
        if w.strategy == "block":
            how = f"block {w.block_structure}"
        return f"{self.format} {kind} ({how}, {'symmetric' if w.symmetric else 'zero points'})"


class CompressedTensorsConfig:
    """A checkpoint's `quantization_config` as compressed-tensors reads it; `raw` is the config.json object."""

    def __init__(self, raw: dict) -> None:
        try:
            self.config = QuantizationConfig.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ValueError(f"field quantization_config.{where} {first['msg']}") from None
        self.sparsity = raw.get("sparsity_config") or {}
        self.transform = raw.get("transform_config") or {}

    @cached_property
    def groups(self) -> list[tuple[str, LayerScheme]]:
        fallback = self.config.format
        groups = []
        for name, scheme in self.config.config_groups.items():
            fmt = getattr(scheme, "format", None) or fallback
            groups.append((name, LayerScheme(scheme, str(getattr(fmt, "value", fmt)))))
        return groups

    def scheme_of(self, layer: str) -> LayerScheme | None:
        """The scheme of the linear layer named `layer` (config_groups' targets, less `ignore`), or None."""
        ignore = self.config.ignore or []
        for _, scheme in self.groups:
            if scheme.scheme.weights is not None and is_match(layer, _LINEAR, scheme.scheme.targets, ignore):
                return scheme
        return None

    def activation_notes(self) -> list[str]:
        """One line per config group whose activations the checkpoint quantizes: kiln runs them in the model dtype."""
        notes = []
        for name, s in self.groups:
            a = s.scheme.input_activations
            if a is not None:
                kind = f"{a.type}{a.num_bits} {a.strategy}, {'dynamic' if a.dynamic else 'static scales'}"
                notes.append(
                    f"quantization_config.config_groups.{name}.input_activations ({kind}): kiln runs weight-only "
                    "quantization; the activations stay in the model dtype"
                )
        if self.config.kv_cache_scheme is not None:
            notes.append(
                "quantization_config.kv_cache_scheme: kiln keeps the KV cache in --kv-cache-dtype (the checkpoint's "
                "KV scales are not read)"
            )
        return notes


def kiln_form(tensors: dict[str, torch.Tensor], layer: LayerScheme) -> PackedTensor | torch.Tensor:
    """One layer's stored tensors (local names) as kiln runs them: packed codes where `layer.packs`, else the
    float weight the package's compressor decompresses."""
    if not layer.packs:
        return _decompressed(tensors, layer)
    w = layer.scheme.weights
    scale = tensors["weight_scale"]
    if w.strategy == "tensor":
        scale = scale.reshape(1, 1)
    if "weight_packed" in tensors:
        shape = torch.Size(int(d) for d in tensors["weight_shape"].tolist())
        q = unpack_from_int32(tensors["weight_packed"], w.num_bits, shape)
    else:
        q = tensors["weight"]
    rows = q.shape[0]
    scale = scale.expand(rows, scale.shape[-1]) if scale.shape[0] == 1 else scale
    zero = tensors.get("weight_zero_point")
    if zero is not None and zero.dtype == torch.int32 and "weight_packed" in tensors:
        zero = unpack_from_int32(zero, w.num_bits, (rows, scale.shape[-1]), packed_dim=0)
    g_idx = tensors.get("weight_g_idx")
    if g_idx is not None:  # activation-ordered groups (GPTQ's actorder): sorted into contiguous columns
        return ordered_form(q, scale, zero, w.num_bits, signed=True, g_idx=g_idx)
    return integer_form(q, scale, zero, w.num_bits, signed=True)


def _decompressed(tensors: dict[str, torch.Tensor], layer: LayerScheme) -> torch.Tensor:
    try:
        compressor = BaseCompressor.get_value_from_registry(layer.format)
    except (KeyError, ValueError) as exc:
        raise ValueError(f"compressed-tensors cannot decompress format {layer.format!r} ({exc})") from None
    weight = compressor.decompress(dict(tensors), layer.scheme)["weight"]
    return weight.float()
