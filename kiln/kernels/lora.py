"""The LoRA products of few rows (a decode step's): the gathered torch form or kiln's native kernel, timed here.

The native kernel (kiln/kernels/native/lora.cpp, `lora_delta`) is Punica's bgmv as one C++ op per adapted layer:
each token's shrink by its own slot's A rows (four tokens of a slot at a time) and expand by its slot's rows of the
transposed B, every part of a fused layer in one call, nothing read for a token without an adapter (a step without
any costs the op's checks). In a traced graph it is one node (its fake is registered here), as the native decode
attention is. Over a packed base (PackedLinear), `NativeForm.bind` binds the layer's buffers to the base's codes in
C++, and the layer runs `kiln::packed_linear_lora(x, codes, scale, offset, slots)`: the base's product and the
adapters' in one call with one more operand. Two ops a layer with the buffers as operands cost ~1 ms more a batch-1
decode token of the default model (120 adapted products; the graph's Python wrapper passes every operand).

`LoRAKernelPlan.choose(model, cache)` times the `gathered` form (kiln.lora.forms) and the native one for each
geometry of the model's LoRALinear layers (inputs, parts, slots, rank, buffer dtype) at a decode step's row counts,
over copies of the buffers that add up to more than a last-level cache (a decode step reads each layer's buffers
once, after the rest of the model has passed through the cache), once per machine (kiln.kernels.choices);
`install` makes each layer's few-row form its geometry's winner. Both are timed as products alone (the fused call
saves the native form a call more), the gathered form as it runs eagerly: inside a full decode graph inductor fuses
it into four loops a layer, which measured 33-47 us a 1-row product against the native kernel's 4-8 us
(docs/benchmarks.md), so the choice holds for both.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from kiln.kernels.choices import KernelChoiceCache, stream_count
from kiln.kernels.native.build import native_op, runnable_tiers, source_hash, tier_by_name
from kiln.kernels.race import Entrant, time_candidates
from kiln.lora.forms import FORMS, GATHERED, LoRAForm
from kiln.lora.layer import LoRALinear
from kiln.quant.linear import PackedLinear

NATIVE = "native"
TIMED_ROWS = (1, 8, 32)  # decode steps' row counts the choice adds up
NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # the buffers (and activations) the kernel reads


@dataclass(frozen=True)
class NativeLoRA:
    """The native tier's LoRA ops: `delta` (lora_delta) and `bind` (bind_lora: a packed layer's buffers bound to its
    codes, for `kiln::packed_linear_lora`)."""

    delta: Callable[..., torch.Tensor]
    bind: Callable[..., None]


@functools.cache
def native_lora() -> NativeLoRA | None:
    """The LoRA ops of the widest tier that loads here, with the fake (shape-only) form a traced graph needs of
    `lora_delta`, and that tier's C++ kernel of `kiln::packed_linear_lora` installed; None where no tier loads."""
    for tier in runnable_tiers():
        ops = {name: native_op(tier.name, name) for name in ("lora_delta", "bind_lora", "install_lora_dispatch")}
        if any(op is None for op in ops.values()):
            continue

        def fake(x, a, b, slots, part_rows, max_loras, rank):
            return x.new_empty(x.shape[0], sum(part_rows), dtype=torch.float32)

        torch.library.register_fake(f"{tier_by_name(tier.name).namespace}::lora_delta", fake)
        ops["install_lora_dispatch"]()
        return NativeLoRA(ops["lora_delta"], ops["bind_lora"])
    return None


# a packed layer's product and its bound LoRA buffers' products (C++ only, dispatch.cpp: installed by native_lora)
_LIB = torch.library.Library("kiln", "FRAGMENT")
_LIB.define("packed_linear_lora(Tensor x, Tensor codes, Tensor scale, Tensor offset, Tensor slots) -> Tensor")


@torch.library.register_fake("kiln::packed_linear_lora", lib=_LIB)
def _fake(x, codes, scale, offset, slots):
    return x.new_empty(x.shape[0], codes.shape[0])


class NativeForm(LoRAForm):
    """The native kernel over the layer's buffers (float32 or bf16), in float32 sums. `fused`: the layer's packed
    base was bound to its buffers (`bind`), and the base's product and the adapters' run as one op,
    `kiln::packed_linear_lora`. The ops are looked up before, never while a graph is traced."""

    name = NATIVE
    any_rows = True  # four tokens of a slot by four A rows at a time: a 2,048-row chunk at 2x the stacked form's speed

    def __init__(self, kernels: NativeLoRA, bound: int | None = None) -> None:
        self.kernels = kernels
        self.bound = bound  # the address of the packed codes `bind` bound the layer's buffers to

    @property
    def fused(self) -> bool:
        return self.bound is not None

    def delta(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        if not _runs(layer, x):
            return FORMS[GATHERED].delta(layer, x)  # a float64 copy (the debugger's reference): the same arithmetic
        buffers = (layer.lora_a, layer.lora_b, layer.tokens.index)
        rows = [rows for _, rows in layer.parts]
        return self.kernels.delta(x.float(), *buffers, rows, layer.max_loras, layer.max_rank).to(x.dtype)

    def forward(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        base = layer.base
        if not (self.fused and base.plain_op(x) and _runs(layer, x)):
            return super().forward(layer, x)
        # NOTE: a copy of the model (its own codes, bound to nothing) runs the separate form; a traced graph holds the
        # op over the layer's own codes, checked here when it is traced
        if not torch.compiler.is_compiling() and base.codes.data_ptr() != self.bound:
            return super().forward(layer, x)
        return torch.ops.kiln.packed_linear_lora(x, base.codes, base.scale, base.offset, layer.tokens.index)

    def bind(self, layer: LoRALinear) -> NativeForm:
        """The form of `layer` as `install` binds it: fused where its base is packed with no input order or bias
        (PackedLinear.plain) and its buffers are the kernel's dtype, else this one."""
        base = layer.base
        if not (isinstance(base, PackedLinear) and base.plain and _takes(layer.lora_a)):
            return self
        rows = [rows for _, rows in layer.parts]
        self.kernels.bind(
            base.codes, layer.lora_a, layer.lora_b, part_rows=rows, max_loras=layer.max_loras, rank=layer.max_rank
        )
        return NativeForm(self.kernels, bound=base.codes.data_ptr())


def _takes(tensor: torch.Tensor) -> bool:
    """Whether the native kernel reads a tensor of this dtype and device."""
    return tensor.dtype in NATIVE_DTYPES and tensor.device.type == "cpu"


def _runs(layer: Any, x: torch.Tensor) -> bool:
    """Whether the native kernel takes this layer's buffers and these activations."""
    return _takes(layer.lora_a) and _takes(x)


def lora_layers(model: nn.Module) -> list[LoRALinear]:
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


def geometry(layer: LoRALinear) -> dict[str, Any]:
    """What a LoRA product's time depends on: the key of its choice."""
    return {
        "in": layer.in_features,
        "parts": [rows for _, rows in layer.parts],
        "max_loras": layer.max_loras,
        "max_rank": layer.max_rank,
        "dtype": str(layer.lora_a.dtype).removeprefix("torch."),
    }


# what a form reads of its layer besides the buffers and the step's slots (kiln.lora.forms.LoRALinear)
SHAPE_FIELDS = ("in_features", "out_features", "max_loras", "max_rank", "parts", "block", "column_slot")


def _view(layer: LoRALinear, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> SimpleNamespace:
    """`layer` as a form reads it, over buffer copies `a` and `b` and a step's `slots`."""
    shape = {name: getattr(layer, name) for name in SHAPE_FIELDS}
    return SimpleNamespace(**shape, base=layer.base, tokens=SimpleNamespace(index=slots), lora_a=a, lora_b=b)


def _race(layer: LoRALinear) -> dict[str, Any]:
    """The gathered and native forms' times (µs) for `layer`'s geometry, summed over TIMED_ROWS."""
    nbytes = layer.lora_a.nbytes + layer.lora_b.nbytes
    copies = [(layer.lora_a.clone().fill_(0.01), layer.lora_b.clone().fill_(0.01)) for _ in range(stream_count(nbytes))]
    totals: dict[str, float] = {GATHERED: 0.0, NATIVE: 0.0}
    for rows in TIMED_ROWS:
        slots = torch.arange(rows) % layer.max_loras  # every slot in use
        views = [(_view(layer, slots, a, b),) for a, b in copies]
        entrants = {
            name: Entrant(lambda form=form: lambda x, view: form.delta(view, x)) for name, form in _forms().items()
        }
        race = time_candidates(entrants, torch.randn(rows, layer.in_features), views)
        for name, us in race.times.items():
            totals[name] += us
    return {"times_us": {k: round(v, 1) for k, v in totals.items()}, "rows": list(TIMED_ROWS)}


@dataclass
class LoRAKernelPlan:
    """Each LoRALinear geometry's few-row form, timed (`choose`); `install` binds them."""

    shapes: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> its geometry
    records: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> its choice record (winner, times)

    @classmethod
    def choose(cls, model: nn.Module, cache: KernelChoiceCache) -> LoRAKernelPlan | None:
        """The plan for `model`'s LoRALinear layers on this machine; None where the model has none, or where no
        native kernel runs here (the gathered form is the only one)."""
        layers = [layer for layer in lora_layers(model) if layer.lora_a.device.type == "cpu"]
        if not layers or native_lora() is None:
            return None
        plan = cls()
        for layer in layers:
            shape = geometry(layer)
            key = _key(shape)
            if key in plan.shapes:
                continue

            def measure(layer: LoRALinear = layer) -> dict[str, Any]:
                record = _race(layer)
                record["winner"] = min(record["times_us"], key=record["times_us"].__getitem__)
                return record

            plan.shapes[key] = shape
            plan.records[key] = cache.choose("lora_few_rows", {**shape, "native": source_hash()}, measure)
        return plan

    def winner(self, layer: LoRALinear) -> str:
        record = self.records.get(_key(geometry(layer)))
        return GATHERED if record is None else str(record["winner"])

    def install(self, model: nn.Module) -> None:
        """Each layer's few-row form: its geometry's winner, the native one bound to the layer (NativeForm.bind)."""
        forms = _forms()
        for layer in lora_layers(model):
            form = forms[self.winner(layer)]
            layer.few_rows = form.bind(layer) if isinstance(form, NativeForm) else form

    def summary(self) -> str:
        """`<winner> for <parts> of <in>` per geometry, for the start-up log."""
        return ", ".join(
            f"{self.records[key]['winner']} for {'+'.join(map(str, shape['parts']))} of {shape['in']}"
            for key, shape in self.shapes.items()
        )


def _forms() -> dict[str, LoRAForm]:
    """The few-row candidates that run here (the native one where a tier loads)."""
    kernels = native_lora()
    return {GATHERED: FORMS[GATHERED], **({NATIVE: NativeForm(kernels)} if kernels is not None else {})}


def _key(shape: dict[str, Any]) -> str:
    return ":".join(str(shape[name]) for name in ("in", "parts", "max_loras", "max_rank", "dtype"))
