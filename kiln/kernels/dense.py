"""Dense bf16 decoder products on oneDNN's prepacked weights, chosen by timing (issue 26, item 5).

`F.linear` over a bf16 weight on CPU runs oneDNN (AVX512-BF16, or AMX where the CPU has it), which lays the weight
out for its kernel again on every call: 45 against 22 µs for 960x576 at one row, 147 against 85 µs for 3072x576 at
32 rows on a 2-core AMX Xeon. The `onednn-prepacked` candidate lays each weight out once
(`mkldnn._reorder_linear_weight`, an opaque oneDNN tensor the kernel holds: a second copy of that weight) and calls
`mkldnn._linear_pointwise` on it; `blas` is `F.linear` as loaded. Both are timed per decoder layout (shape, dtype)
and row count (kiln.kernels.packed's ROWS but the static GEMV sizes, whose pieces reduce over the weight itself),
over copies of the weight streamed as the packed table streams them, fewest rows first (kiln.kernels.race), and
cached per machine. Where the prepacked kernel wins a row class, the layers of that layout run
`torch.ops.kiln.dense_linear(x, weight, bias)` (one node in pieces and in the full decode graph, as
`kiln::packed_linear` is), which runs the kernel bound to the weight for the step's rows, `F.linear` elsewhere.
Where kiln's native objects load, the op's CPU kernel is C++ (kiln/kernels/native/dispatch.cpp: a copy
of the bindings kept there, oneDNN called without a hop through Python); elsewhere it is the Python function below.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import cache, partial
from typing import Any

import torch
from torch import nn

from kiln.kernels.choices import KernelChoiceCache, stream_count
from kiln.kernels.native.build import native_dense_binder
from kiln.kernels.race import RULES, Entrant, time_candidates
from kiln.quant.ops import BoundKernels, row_class, rows_label

logger = logging.getLogger("kiln")

BLAS, PREPACKED = "blas", "onednn-prepacked"
DTYPES = (torch.bfloat16,)  # where oneDNN's per-call reorder is what prepacking saves (float32 runs MKL)
STREAM_BYTES = 96 << 20
MEMORY_SHARE = 0.5  # prepacked copies may take at most this share of the memory free at install
DenseKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]  # (x, weight, bias)
_BOUND = BoundKernels[DenseKernel]()

_LIB = torch.library.Library("kiln", "FRAGMENT")
_LIB.define("dense_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    kernel = _BOUND.get(weight, x.numel() // x.shape[-1])
    return nn.functional.linear(x, weight, bias) if kernel is None else kernel(x, weight, bias)


_LIB.impl("dense_linear", dense_linear, "CompositeExplicitAutograd")
_LIB.define("dense_linear_bound(Tensor x, Tensor weight, Tensor? bias) -> Tensor")  # what the C++ kernel falls to
_LIB.impl("dense_linear_bound", dense_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("kiln::dense_linear", lib=_LIB)
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def bind_dense_kernels(weight: torch.Tensor, kernels: dict[int, DenseKernel]) -> None:
    """Run `kernels` (by row class) for products with `weight`; a row class without one runs `F.linear`."""
    entries = _BOUND.bind(weight, kernels)
    binder = native_dense_binder()
    if binder is not None:  # the C++ kernel of the op runs prepacked copies and F.linear (other kernels: this module)
        packed = [k.packed.get(weight.data_ptr()) if isinstance(k, Prepacked) else None for k in entries]
        binder(weight, packed, [k is not None and p is None for k, p in zip(entries, packed, strict=True)])


class DenseLinear(nn.Linear):
    """An `nn.Linear` whose product is `kiln::dense_linear` (the kernels bound to its weight)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.kiln.dense_linear(x, self.weight, self.bias)


class Prepacked:
    """oneDNN's product over its own prepacked copy of a weight (made once, at the first call for that weight)."""

    def __init__(self) -> None:
        self.packed: dict[int, torch.Tensor] = {}  # the weight's address -> its prepacked copy

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        packed = self.packed.get(weight.data_ptr())
        if packed is None:
            packed = self.packed[weight.data_ptr()] = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
        return packed

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.pack(weight), bias, "none", [], "")


def prepacking_runs(weight: torch.Tensor) -> bool:
    """oneDNN's prepacked product runs here for this weight: a CPU tensor of a timed dtype, mkldnn built in, and a
    CPU oneDNN's bf16 path runs on (AVX512 BW/VL/DQ or AVX-NE-CONVERT: on an AVX2-only CPU the reorder raises)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and onednn_bf16_runs()
    )


@cache
def onednn_bf16_runs() -> bool:
    """Whether oneDNN's bf16 kernels run on this CPU (torch's own cpuid check, the one the reorder makes)."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(probe()) if probe is not None else False


def dense_layers(model: nn.Module) -> list[nn.Linear]:
    """The decoder's plain linear layers and a plain logits head (exactly `nn.Linear`: a parallel or quantized
    subclass keeps its own)."""
    head = getattr(model, "lm_head", None)
    layers = [*model.model.layers.modules(), *([head] if head is not None else [])]
    return [m for m in layers if type(m) in (nn.Linear, DenseLinear)]


def label(layer: nn.Linear) -> str:
    return f"{layer.out_features}x{layer.in_features} {str(layer.weight.dtype).removeprefix('torch.')}"


class DenseKernelTable:
    """Timed choices for every distinct dense decoder layout a prepacked kernel runs for; `install` binds them."""

    def __init__(
        self, model: nn.Module, cache: KernelChoiceCache, rows: tuple[int, ...], head_rows: tuple[int, ...]
    ) -> None:
        """`rows`: the row counts timed (one per row class, kiln.kernels.packed.ROWS but static GEMV sizes);
        `head_rows`: those of them the logits head is asked for (a layer of the head's layout gets all)."""
        self.layers = [m for m in dense_layers(model) if prepacking_runs(m.weight)]
        self.distinct = {label(m): m for m in self.layers}
        head = getattr(model, "lm_head", None)
        others = {label(m) for m in self.layers if m is not head}
        self.rows = {name: rows if m is not head or name in others else head_rows for name, m in self.distinct.items()}
        self.records: dict[str, dict[str, Any]] = {}
        for name, layer in self.distinct.items():
            timed = self.rows[name]
            key = {"shape": list(layer.weight.shape), "dtype": name.split()[1], "rows": list(timed), "race": RULES}
            self.records[name] = cache.choose("dense_kernels", key, partial(_time, layer.weight, timed))

    def prepacked_rows(self, layer: nn.Linear) -> list[int]:
        winners = self.records[label(layer)]["winners"]
        return [rows for rows in self.rows[label(layer)] if winners.get(str(rows)) == PREPACKED]

    def install(self, available_bytes: float | None = None) -> int:
        """Bind each layer's prepacked kernel for the row classes it won (its copy made here) and make the layer run
        `kiln::dense_linear`; the bytes of the prepacked copies. Copies that would take more than MEMORY_SHARE of
        `available_bytes` (memory free after the weights and the KV cache) are not made: `F.linear` runs, and a log
        line says so."""
        won = {id(layer): self.prepacked_rows(layer) for layer in self.layers}
        need = sum(layer.weight.numel() * layer.weight.element_size() for layer in self.layers if won[id(layer)])
        if available_bytes is not None and need > MEMORY_SHARE * available_bytes:
            logger.info(
                "Dense kernels: prepacked copies (%.0f MB) would take more than %d%% of the %.0f MB free: "
                "F.linear runs",
                need / 2**20,
                MEMORY_SHARE * 100,
                available_bytes / 2**20,
            )
            won = {key: [] for key in won}
        for layer in self.layers:
            if not won[id(layer)] and type(layer) is nn.Linear:
                continue
            kernel = Prepacked()
            if won[id(layer)]:
                kernel.pack(layer.weight)
            bind_dense_kernels(layer.weight, {row_class(rows): kernel for rows in won[id(layer)]})  # none: F.linear
            layer.__class__ = DenseLinear
        return need if any(won.values()) else 0

    def summary(self) -> str:
        return "; ".join(
            f"{name}: " + ", ".join(f"{rows_label(r)} {rec['winners'][str(r)]}" for r in self.rows[name])
            for name, rec in self.records.items()
        )


def _time(weight: torch.Tensor, rows_timed: tuple[int, ...]) -> dict[str, Any]:
    """Race the two candidates at each row count, fewest rows first; a candidate's time at fewer rows is its
    floor at more (kiln.kernels.race). The prepacked copies are made before the race (as at install)."""
    count = stream_count(weight.numel() * weight.element_size(), STREAM_BYTES)
    copies = [(weight.detach().clone(),) for _ in range(count)]

    def packed() -> Prepacked:
        for (copy,) in copies:
            prepacked.pack(copy)
        return prepacked

    times: dict[str, dict[str, float]] = {}
    winners: dict[str, str] = {}
    floors: dict[str, float] = {}
    prepacked = Prepacked()
    for rows in rows_timed:
        x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
        entrants = {
            BLAS: Entrant(make=lambda: nn.functional.linear, floor=partial(_at_least, floors.get(BLAS, 0.0))),
            PREPACKED: Entrant(make=packed, floor=partial(_at_least, floors.get(PREPACKED, 0.0))),
        }
        race = time_candidates(entrants, x, copies)
        times[str(rows)], winners[str(rows)] = race.times, race.winner
        floors |= race.ruled_out | race.times
    return {"winners": winners, "times_us": times}


def _at_least(least: float, times: dict[str, float]) -> float:
    return least
