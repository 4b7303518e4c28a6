"""The quantized layers of one HF checkpoint (kiln.model.loader.hf_quant says which tensors make one up): their
names, their [out, in] shapes from the header, their packed layouts, and each layer read as kiln runs it."""

from __future__ import annotations

import torch

from kiln.model.loader.hf_quant import CheckpointQuantization, Layout, Reader, Shapes
from kiln.quant.linear import PackedTensor


class QuantizedLayers:
    """The quantized layers of one HF checkpoint, from its header: `stored` tensor name -> shape and `read(name)`
    reading one stored tensor. A float checkpoint (`quantization` None) has none."""

    def __init__(
        self,
        quantization: CheckpointQuantization | None,
        stored: dict[str, tuple[int, ...]],
        read: Reader,
    ) -> None:
        self.quantization = quantization
        self.read = read
        self.parts: dict[str, dict[str, str]] = {}  # layer -> local name -> stored name
        q = quantization
        for name in stored if q is not None else ():
            layer, _, local = name.rpartition(".")
            if local == q.marker:  # a layer the config ignores is stored plain, without it
                self.parts[layer] = {n: f"{layer}.{n}" for n in q.local_names if f"{layer}.{n}" in stored}
        self.stored_names = {name for parts in self.parts.values() for name in parts.values()}
        self._stored = stored
        self._layouts: dict[str, Layout | None] = {}

    def _shapes(self, layer: str) -> Shapes:
        return {local: self._stored[name] for local, name in self.parts[layer].items()}

    def _reader(self, layer: str) -> Reader:
        return lambda local: self.read(self.parts[layer][local])

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """`<layer>.weight` -> its [out, in] shape, for every quantized layer."""
        q = self.quantization
        return {f"{layer}.weight": q.shape(layer, self._shapes(layer), self._reader(layer)) for layer in self.parts}

    def layout(self, hf_name: str) -> Layout | None:
        """(bits, group) when `hf_name` (`<layer>.weight`) loads packed; None for every other tensor."""
        layer = hf_name.removesuffix(".weight")
        if layer == hf_name or layer not in self.parts or self.quantization is None:
            return None
        if layer not in self._layouts:
            self._layouts[layer] = self.quantization.layout(layer, self._shapes(layer), self._reader(layer))
        return self._layouts[layer]

    def load(self, layer: str) -> PackedTensor | torch.Tensor:
        """The layer's weight as kiln runs it (packed codes, or float32)."""
        tensors = {local: self.read(name) for local, name in self.parts[layer].items()}
        return self.quantization.read_layer(layer, tensors)
