"""Which decoder stacks kiln.compile.stamp may trace through three layers: layers that trace to the same nodes.

A layer's trace depends on its modules' types, their attributes (`window`, `inline_rows`, sizes: dynamo bakes
them in as constants or branches) and its tensors' shapes, dtypes and strides; `layer_idx` is the one attribute
that differs along a stack, and stamping gives each copy its own (the attention op's argument, the KV cache).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

TEMPLATE_LAYERS = 3  # the first (it may compute what later layers share), the previous one, the template
_PRIMITIVE = (int, float, str, bool, type(None), torch.dtype, torch.device)


def stampable_layers(model: nn.Module) -> list[int] | None:
    """The decoder's layer indices when its forward can be traced through three and the rest stamped: it offers
    `tracing_layers`, runs more than three layers, and they are alike (`layer_signature`); else None."""
    decoder = getattr(model, "model", None)
    held = getattr(decoder, "held", None)
    if decoder is None or held is None or not hasattr(decoder, "tracing_layers") or len(held) <= TEMPLATE_LAYERS:
        return None
    signatures = {layer_signature(decoder.layers[i]) for i in held}
    return list(held) if len(signatures) == 1 else None


def layer_signature(layer: nn.Module) -> tuple[Any, ...]:
    """What a layer's trace depends on: each module's type, its attributes (but `layer_idx`) and its tensors'
    shapes, dtypes and strides. Two layers with one signature trace to the same nodes."""
    parts: list[Any] = []
    for name, module in layer.named_modules():
        attrs = sorted((k, describe(v)) for k, v in vars(module).items() if not k.startswith("_") and k != "layer_idx")
        tensors = [(k, describe(t)) for k, t in (*module._parameters.items(), *module._buffers.items())]
        parts.append((name, type(module).__module__, type(module).__qualname__, tuple(attrs), tuple(tensors)))
    return tuple(parts)


def describe(value: object) -> object:
    """A value as a layer's trace sees it (a tensor by its layout, an object by its type)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.stride(), value.dtype, value.device.type)
    if isinstance(value, _PRIMITIVE):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(describe(v) for v in value)
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted(repr(v) for v in value)))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return repr(value)
    return type(value).__qualname__  # a module (compared on its own) or an object whose identity does not trace
