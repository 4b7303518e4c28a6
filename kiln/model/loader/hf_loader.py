"""HF model directories: config.json + *.safetensors + tokenizer.json.

Construction reads config.json and every safetensors header, checking each header against its file (types,
offsets, size) so a cut or corrupt shard fails before any weight is read; `weights()` then reads one tensor at a time.
A quantized checkpoint (`quantization_config`: compressed-tensors, GPTQ, AWQ; kiln.model.loader.hf_quant) yields
each quantized layer as one `<layer>.weight`: packed codes (kiln.quant.linear.PackedTensor) or a float weight.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from kiln.config import ModelConfig
from kiln.errors import ModelLoadError
from kiln.model.loader.base import CheckpointHeader
from kiln.model.loader.hf_config import parse_config, read_config_json
from kiln.model.loader.hf_quant import CheckpointQuantization, Layout, read_quantization
from kiln.model.loader.hf_quant_layers import QuantizedLayers
from kiln.quant.linear import PackedTensor

SUPPORTED_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}  # safetensors dtype -> bytes per element


class TensorReader:
    """One safetensors tensor not read yet: `whole()`, or `narrow(dim, start, length)` reading only those rows or
    columns from the file (safetensors' `get_slice`)."""

    def __init__(self, handle: Any, name: str) -> None:
        self.handle, self.name = handle, name
        self.shape = tuple(handle.get_slice(name).get_shape())

    def whole(self) -> torch.Tensor:
        return self.handle.get_tensor(self.name)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self.handle.get_slice(self.name)[tuple(index)]


@dataclass(frozen=True)
class SafetensorsEntry:
    """One tensor of a safetensors header; offsets count from the end of the header."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def read_safetensors_header(path: Path) -> dict[str, SafetensorsEntry]:
    """The tensors a .safetensors file declares, checked against the file size (no tensor data is read)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ModelLoadError(str(path), f"truncated: {len(raw)} bytes, shorter than a safetensors header")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                raise ModelLoadError(
                    str(path), f"truncated or corrupt: the header claims {n} bytes, the whole file has {size}"
                )
            text = f.read(n)
    except OSError as exc:
        raise ModelLoadError(str(path), f"cannot read the file ({exc.strerror or exc})") from None
    try:
        header = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(str(path), f"corrupt safetensors header: not UTF-8 JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ModelLoadError(str(path), f"corrupt safetensors header: expected a JSON object, found {header!r:.60}")
    header.pop("__metadata__", None)
    entries = {name: _parse_entry(path, name, info) for name, info in header.items()}
    data_size = size - 8 - n
    for name, e in entries.items():
        if e.end > data_size:
            raise ModelLoadError(
                str(path),
                f"truncated: tensor {name} ends at data byte {e.end} but the file holds {data_size} bytes of data",
            )
    return entries


def _parse_entry(path: Path, name: str, info: object) -> SafetensorsEntry:
    """One header entry, checked: a dtype, a shape of sizes, offsets whose span fits the shape."""

    def corrupt(found: str) -> ModelLoadError:
        return ModelLoadError(str(path), f"corrupt safetensors header: tensor {name} {found}")

    if not isinstance(info, dict):
        raise corrupt(f"is {info!r:.60}, expected an object with dtype, shape and data_offsets")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str):
        raise corrupt(f"has dtype {dtype!r}, expected a type name such as F32")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise corrupt(f"has shape {shape!r}, expected a list of sizes")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise corrupt(f"has data_offsets {offsets!r}, expected [start, end] with 0 <= start <= end")
    start, end = offsets
    if dtype in SUPPORTED_DTYPES and end - start != math.prod(shape) * SUPPORTED_DTYPES[dtype]:
        raise corrupt(
            f"spans {end - start} bytes, but {dtype} of shape {tuple(shape)} needs "
            f"{math.prod(shape) * SUPPORTED_DTYPES[dtype]}"
        )
    return SafetensorsEntry(dtype, tuple(shape), start, end)


class HFCheckpoint:
    """An HF-format directory; construction reads config.json and the safetensors headers only."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.dir = Path(path)
        self.config_path = self.dir / "config.json"
        if not self.config_path.is_file():
            raise ModelLoadError(path, "not a model directory: config.json is missing")
        self.hf_config = read_config_json(self.config_path)
        self.files = sorted(self.dir.glob("*.safetensors"))
        if not self.files:
            raise ModelLoadError(path, "no *.safetensors weight files in the directory")
        self.headers = {f: read_safetensors_header(f) for f in self.files}
        self.file_by_tensor: dict[str, Path] = {}
        for f, header in self.headers.items():
            for name in header:
                if name in self.file_by_tensor:
                    other = self.file_by_tensor[name].name
                    raise ModelLoadError(str(f), f"tensor {name} is also in {other}; each tensor must be stored once")
                self.file_by_tensor[name] = f
        self.quantization: CheckpointQuantization | None = read_quantization(str(self.config_path), self.hf_config)
        self.quantized = QuantizedLayers(self.quantization, self._stored_shapes(), self._read)

    @cached_property
    def tensor_types(self) -> dict[str, str]:
        """Tensor name -> storage type; a quantized layer's weight by what it holds ("INT4", "FP8", ...)."""
        types = {name: e.dtype for h in self.headers.values() for name, e in h.items()}
        types = {name: t for name, t in types.items() if name not in self.quantized.stored_names}
        kind = self.quantization.weights().upper() if self.quantization is not None else ""
        return types | {name: kind for name in self.quantized.weight_shapes()}

    @cached_property
    def config(self) -> ModelConfig:
        return parse_config(self.config_path, self.hf_config)

    def header(self) -> CheckpointHeader:
        return CheckpointHeader(
            path=self.path,
            format="hf",
            config=self.config,
            tensor_types=dict(self.tensor_types),
            tensor_shapes=self._shapes(),
        )

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor `weights()` yields (HF names), from the headers (after the same dtype
        check as `weights()`)."""
        self._check_dtypes()
        return self._shapes()

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        plain = {n: s for n, s in self._stored_shapes().items() if n not in self.quantized.stored_names}
        return plain | self.quantized.weight_shapes()

    def _stored_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: e.shape for h in self.headers.values() for name, e in h.items()}

    def _read(self, name: str) -> torch.Tensor:
        path = self.file_by_tensor[name]
        try:
            with safe_open(str(path), framework="pt") as st:
                return st.get_tensor(name)
        except SafetensorError as exc:
            raise ModelLoadError(str(path), f"corrupt safetensors file ({exc})") from None

    def packed_layout(self, hf_name: str) -> Layout | None:
        """(bits per code, group size) when `weights()` yields this tensor packed (a quantized layer kiln keeps
        packed), else None."""
        return self.quantized.layout(hf_name)

    def file_of(self, name: str) -> str:
        """The shard that stores tensor `name` (a quantized layer's weight: its marker tensor); the directory for a
        tensor no shard has."""
        parts = self.quantized.parts.get(name.removesuffix(".weight"), {})
        stored = next(iter(parts.values()), name)
        return str(self.file_by_tensor.get(stored, self.dir))

    def tensor_label(self, name: str) -> str:
        return name

    def rope_freq_factors(self) -> torch.Tensor | None:
        return None

    @property
    def num_tensors(self) -> int:
        return len(self.tensor_types)

    def weights(self, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor | TensorReader | PackedTensor]]:
        """Yield (HF name, tensor) pairs, one shard and one tensor at a time; with `lazy`, a `TensorReader` instead,
        which reads the tensor, or only the part of it a tensor-parallel rank holds, when asked (valid until the next
        pair is taken). Quantized layers come last, each as `<layer>.weight`: a PackedTensor or a float32 tensor."""
        self._check_dtypes()
        for f in self.files:
            try:
                with safe_open(str(f), framework="pt") as st:
                    for name in st.keys():  # noqa: SIM118  (safe_open is not a dict)
                        if name not in self.quantized.stored_names:
                            yield name, TensorReader(st, name) if lazy else st.get_tensor(name)
            except SafetensorError as exc:
                raise ModelLoadError(str(f), f"corrupt safetensors file ({exc})") from None
        for layer in self.quantized.parts:
            try:
                weight = self.quantized.load(layer)
            except (ValueError, RuntimeError) as exc:
                method = self.quantization.method if self.quantization is not None else ""
                raise ModelLoadError(self.file_of(f"{layer}.weight"), f"{method} layer {layer}: {exc}") from None
            yield f"{layer}.weight", weight

    def _check_dtypes(self) -> None:
        quantized = self.quantized.stored_names
        for f, header in self.headers.items():
            bad = [(n, e.dtype) for n, e in header.items() if e.dtype not in SUPPORTED_DTYPES and n not in quantized]
            if bad:
                (name, dtype), more = bad[0], f" and {len(bad) - 1} more" if len(bad) > 1 else ""
                raise ModelLoadError(
                    str(f),
                    f"unsupported tensor dtype {dtype} (tensor {name}{more}); kiln loads {', '.join(SUPPORTED_DTYPES)}",
                )
