"""An HF checkpoint's `quantization_config`: which of its stored tensors make up each quantized layer, the layer's
logical [out, in] shape, and the form kiln runs it in (kiln.quant: packed codes with scales and offsets, or a float
weight dequantized at load).

One class per `quant_method` (a new method is one class and one `METHODS` entry):
- `compressed-tensors`: read through the compressed-tensors package (kiln.quant.compressed);
- `gptq`: `bits` 4 or 8, `group_size`, `sym`, `desc_act` with `g_idx`, `checkpoint_format` gptq | gptq_v2;
- `awq`: `version: gemm`, `bits` 4, `group_size`, `zero_point`.
Anything else is a ModelLoadError naming the field and what kiln reads instead.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import torch

from kiln.errors import ConfigError, ModelLoadError
from kiln.model.loader.base import ConfigFields
from kiln.quant.codes import packable_order, packed_group
from kiln.quant.gptq_awq import awq_form, gptq_form
from kiln.quant.linear import PackedTensor

if TYPE_CHECKING:
    from kiln.quant.compressed import LayerScheme

Layout = tuple[int, int]  # (bits per code, group size) of a packed weight
Shapes = dict[str, tuple[int, ...]]  # a layer's local tensor name -> stored shape
Reader = Callable[[str], torch.Tensor]  # a layer's local tensor name -> the tensor


class CheckpointQuantization(ABC):
    """What `quantization_config` says. A quantized layer is the tensors `<layer>.<local>` for the `local_names`,
    present when `<layer>.<marker>` is (a layer left unquantized, such as an ignored lm_head, is stored plain); it
    loads as one tensor `<layer>.weight` of `shape(...)`."""

    method: ClassVar[str]
    marker: ClassVar[str]
    local_names: ClassVar[tuple[str, ...]]

    def __init__(self, fields: ConfigFields) -> None:
        self.fields = fields

    @abstractmethod
    def describe(self) -> str:
        """The checkpoint's quantization in a few words, for messages and the log."""

    @abstractmethod
    def weights(self) -> str:
        """What its quantized layers hold, as `--quantization` and a recipe's `weights.source_quantization` name
        it: "int4", "int8" or "fp8"."""

    @abstractmethod
    def shape(self, layer: str, shapes: Shapes, read: Reader) -> tuple[int, int]:
        """The layer's [out, in] weight shape."""

    @abstractmethod
    def layout(self, layer: str, shapes: Shapes, read: Reader) -> Layout | None:
        """(bits, group) of the packed form `read_layer` yields, None when it yields a float weight."""

    @abstractmethod
    def read_layer(self, layer: str, tensors: dict[str, torch.Tensor]) -> PackedTensor | torch.Tensor:
        """The layer's weight from its local tensors: packed codes, or a float32 tensor."""

    def notes(self) -> list[str]:
        """Lines for the log: what the checkpoint asks that kiln runs otherwise."""
        return []

    def run_mode(self, asked: str, path: str) -> str:
        """How the engine runs this checkpoint for `--quantization asked`: "packed" (auto, packed, or the width it
        holds: the stored codes stay packed where kiln has a form for them) or "none" (everything dequantized to
        the model dtype); quantizing its weights again at another width contradicts the checkpoint (ConfigError)."""
        held = self.weights()
        if asked in ("auto", "packed", held):
            return "packed"
        if asked == "none":
            return "none"
        raise ConfigError(
            f"--quantization {asked} contradicts {path}: its config.json quantization_config says it holds "
            f"{self.describe()} weights; use --quantization auto (or {held}) to run them as stored, or none to "
            "dequantize them"
        )


class CompressedTensors(CheckpointQuantization):
    method = "compressed-tensors"
    marker = "weight_scale"
    # the local tensors a compressed-tensors layer may store; its weight_scale marks it quantized
    local_names = (
        "weight",
        "weight_packed",
        "weight_scale",
        "weight_zero_point",
        "weight_shape",
        "weight_g_idx",
        "weight_global_scale",
        "input_scale",
        "input_zero_point",
        "input_global_scale",
        "output_scale",
        "output_zero_point",
    )

    def __init__(self, fields: ConfigFields, raw: dict) -> None:
        super().__init__(fields)
        # NOTE: imported here: compressed-tensors imports transformers, seconds that float checkpoints never pay
        from kiln.quant.compressed import CompressedTensorsConfig, kiln_form

        self.kiln_form = kiln_form
        try:
            self.config = CompressedTensorsConfig(raw)
        except ValueError as exc:
            raise ModelLoadError(fields.path, str(exc)) from None
        if self.config.sparsity:
            raise fields.error("sparsity_config", "is set: kiln runs dense weights; load a checkpoint without sparsity")
        if self.config.transform:
            raise fields.error(
                "transform_config", "is set: kiln does not apply rotations to weights or activations (SpinQuant)"
            )

    def scheme(self, layer: str) -> LayerScheme:
        scheme = self.config.scheme_of(layer)
        if scheme is None:
            raise self.fields.error(
                "config_groups", f"has no scheme for the stored quantized layer {layer} (its targets miss it)"
            )
        return scheme

    def describe(self) -> str:
        schemes = dict.fromkeys(s.describe() for _, s in self.config.groups if s.scheme.weights is not None)
        return f"compressed-tensors {', '.join(schemes)}"

    def weights(self) -> str:
        schemes = [s for _, s in self.config.groups if s.scheme.weights is not None]
        if any(s.packs for s in schemes):
            return f"int{max(s.bits for s in schemes if s.packs)}"
        return f"fp{max(s.bits for s in schemes)}"

    def shape(self, layer: str, shapes: Shapes, read: Reader) -> tuple[int, int]:
        self.scheme(layer)  # NOTE: a stored layer no scheme describes fails here, before any weight is read
        if "weight_shape" in shapes:
            rows, cols = (int(d) for d in read("weight_shape").tolist())
            return rows, cols
        rows, cols = shapes["weight"]
        return rows, cols

    def layout(self, layer: str, shapes: Shapes, read: Reader) -> Layout | None:
        scheme = self.scheme(layer)
        if not scheme.packs:
            return None
        _, cols = self.shape(layer, shapes, read)
        scale = shapes["weight_scale"]
        groups = scale[-1] if scheme.scheme.weights.strategy == "group" else 1
        if "weight_g_idx" in shapes and not packable_order(read("weight_g_idx"), cols, groups):
            return None
        group = packed_group(cols, groups)
        return None if group is None else (scheme.bits, group)

    def read_layer(self, layer: str, tensors: dict[str, torch.Tensor]) -> PackedTensor | torch.Tensor:
        return self.kiln_form(tensors, self.scheme(layer))

    def notes(self) -> list[str]:
        notes = self.config.activation_notes()
        for name, s in self.config.groups:
            if s.scheme.weights is not None and not s.packs:
                notes.append(
                    f"quantization_config.config_groups.{name}: {s.describe()} weights have no packed kiln form: "
                    "kiln dequantizes them to the model dtype at load"
                )
        return notes


class GPTQ(CheckpointQuantization):
    method = "gptq"
    marker = "qweight"
    local_names = ("qweight", "qzeros", "scales", "g_idx")
    BITS = (4, 8)
    FORMATS = ("gptq", "gptq_v2")

    def __init__(self, fields: ConfigFields, raw: dict) -> None:
        super().__init__(fields)
        self.bits = _one_of(fields, "bits", self.BITS)
        self.group_size = raw.get("group_size", 128)
        if not isinstance(self.group_size, int) or isinstance(self.group_size, bool) or self.group_size == 0:
            raise fields.error("group_size", f"must be a positive integer or -1 (one group), found {self.group_size!r}")
        self.desc_act = fields.flag("desc_act", False)
        self.sym = fields.flag("sym", True)
        self.checkpoint_format = _one_of(fields, "checkpoint_format", self.FORMATS, "gptq")

    def describe(self) -> str:
        group = "channel" if self.group_size < 0 else f"group {self.group_size}"
        order = ", act order" if self.desc_act else ""
        return f"gptq int{self.bits} ({group}, {'symmetric' if self.sym else 'zero points'}{order})"

    def weights(self) -> str:
        return f"int{self.bits}"

    def shape(self, layer: str, shapes: Shapes, read: Reader) -> tuple[int, int]:
        return shapes["scales"][1], shapes["qweight"][0] * 32 // self.bits

    def layout(self, layer: str, shapes: Shapes, read: Reader) -> Layout | None:
        _, cols = self.shape(layer, shapes, read)
        groups = shapes["scales"][0]
        if "g_idx" in shapes and not packable_order(read("g_idx"), cols, groups):
            return None
        group = packed_group(cols, groups)
        return None if group is None else (self.bits, group)

    def read_layer(self, layer: str, tensors: dict[str, torch.Tensor]) -> PackedTensor | torch.Tensor:
        return gptq_form(tensors, self.bits, zero_minus_one=self.checkpoint_format == "gptq")

    def notes(self) -> list[str]:
        if not self.desc_act:
            return []
        return [
            "quantization_config.desc_act is true: each layer's act-ordered groups (g_idx) are sorted into "
            "contiguous columns at load and its input permuted to match; layers whose groups differ in size load "
            "dequantized"
        ]


class AWQ(CheckpointQuantization):
    method = "awq"
    marker = "qweight"
    local_names = ("qweight", "qzeros", "scales")

    def __init__(self, fields: ConfigFields, raw: dict) -> None:
        super().__init__(fields)
        self.bits = _one_of(fields, "bits", (4,))
        self.group_size = fields.positive_int("group_size", 128)
        version = str(raw.get("version", "gemm")).lower()
        if version != "gemm":
            raise fields.error("version", f"is {version!r}: kiln reads AWQ's gemm layout (qweight [in, out / 8])")
        if not fields.flag("zero_point", True):
            raise fields.error("zero_point", "is false: kiln reads AWQ checkpoints with zero points (qzeros)")

    def describe(self) -> str:
        return f"awq int{self.bits} (group {self.group_size}, zero points, gemm)"

    def weights(self) -> str:
        return f"int{self.bits}"

    def shape(self, layer: str, shapes: Shapes, read: Reader) -> tuple[int, int]:
        return shapes["scales"][1], shapes["qweight"][0]

    def layout(self, layer: str, shapes: Shapes, read: Reader) -> Layout | None:
        _, cols = self.shape(layer, shapes, read)
        group = packed_group(cols, shapes["scales"][0])
        return None if group is None else (self.bits, group)

    def read_layer(self, layer: str, tensors: dict[str, torch.Tensor]) -> PackedTensor | torch.Tensor:
        return awq_form(tensors, self.bits)


METHODS: dict[str, type[CheckpointQuantization]] = {m.method: m for m in (CompressedTensors, GPTQ, AWQ)}


def read_quantization(path: str, hf_config: dict) -> CheckpointQuantization | None:
    """The checkpoint's quantization (None without a `quantization_config`); a method or setting kiln does not
    read is a ModelLoadError naming the field."""
    raw = hf_config.get("quantization_config")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ModelLoadError(path, f"field quantization_config must be an object, found {raw!r:.60}")
    fields = ConfigFields(path, raw.get, "quantization_config.")
    method = raw.get("quant_method")
    if method not in METHODS:
        raise fields.error(
            "quant_method",
            f"is {method!r}: kiln reads {', '.join(METHODS)} checkpoints (for another one, load its float weights, "
            "optionally with --quantization int8|int4)",
        )
    return METHODS[method](fields, raw)


def _one_of(fields: ConfigFields, key: str, allowed: tuple, default: object = None) -> object:
    value = fields.lookup(key)
    value = default if value is None else value
    if value not in allowed:
        raise fields.error(key, f"is {value!r}: kiln reads {', '.join(str(a) for a in allowed)}")
    return value
