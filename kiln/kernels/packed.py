"""The kernel table of packed products (`torch.ops.kiln.packed_linear`, kiln.quant.ops): for every packed layer
layout the model uses and every row count the table covers, the candidate kernels are timed on this machine, over
copies of the weight streamed from DRAM, and the winner is cached per machine (kiln.kernels.choices) and bound to
the layers of that layout (`PackedLinear.use_kernels`). Nothing is assumed from the box the code was written on.

Candidates for `x [rows, in] @ W.T`, W packed as codes, scales and offsets per group, one `PackedCandidate` each in
`CANDIDATES` (a new kernel is one subclass and one entry):
- `dequant-blas`: W dequantized by torch ops, then the BLAS product (the reference);
- `compiled-dequant-blas`: W dequantized by one inductor kernel, then the BLAS product;
- `tiled-dequant-blas` (more than 2 rows, more than TILE_ROWS outputs): the same, TILE_ROWS output rows at a time,
  so each dequantized tile is still in cache when BLAS reads it (the logits head at batch 32: 20 ms against 70 ms
  dequantized whole and 27 ms for the float32 head, measured on a 2-core EPYC);
- `fused-reduction` (1 and 2 rows): the product as one reduction over the codes (kiln.quant.ops.reduction),
  compiled for the static row count, so the weight streams at its packed width and is never written out;
- `int4pack-mm` (4-bit codes in groups of 32, where this torch has the op): torch's CPU int4 kernel over a copy
  of the codes repacked into its layout (held by the kernel, made once per weight);
- `native` (float32 activations and scales, where kiln's C++ kernels build and load here): kiln's own kernel
  (kiln.kernels.native) over the packed codes as they are, the weight dequantized in registers, at any row count;
  of the ISA tiers this CPU can run, the widest (the tier is what cpuid allows; timing picks the kernel).
Rows timed: the largest of each row class (1, 2, 16 for 3-16 rows, 64 for 17-64: batched decode) and LARGE_ROWS
for more (prefill chunks), one entry each (kiln.quant.ops.row_class).
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
from torch import nn
from tqdm import tqdm

from kiln.compile.compiler import PieceCompiler
from kiln.kernels.choices import KernelChoiceCache, stream_count
from kiln.kernels.native.build import native_op, runnable_tiers, source_hash
from kiln.kernels.product import Compiled
from kiln.quant.linear import PackedLinear
from kiln.quant.ops import (
    GEMV_ROWS,
    ROW_CLASSES,
    Kernel,
    dequant_blas,
    dequantize_codes,
    reduction,
    row_class,
)

logger = logging.getLogger("kiln")

TILE_ROWS = 2048  # output rows dequantized at a time by TILED: a tile stays in cache for its product
LARGE_ROWS = 256
STREAM_BYTES = 96 << 20  # copies of a layer that add up to more than a last-level cache
ROWS = (*ROW_CLASSES, LARGE_ROWS)
TIMED_ROWS = {row_class(rows): rows for rows in ROWS}  # row class -> the row count timed for it
Weight = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # codes, scale, offset


class PackedCandidate(ABC):
    """One way to compute a packed product. `applies` says for which layers and row counts it is timed; `make`
    builds the kernel for a layer (compiled for `rows` when it compiles), which must compute on any weight of the
    layer's layout passed to it (the timing calls it on copies)."""

    name: ClassVar[str]

    def applies(self, layer: PackedLinear, rows: int) -> bool:
        return True

    @abstractmethod
    def make(self, layer: PackedLinear, rows: int, compiler: PieceCompiler, weights: list[Weight]) -> Kernel: ...


class DequantBlas(PackedCandidate):
    name = "dequant-blas"

    def make(self, layer: PackedLinear, rows: int, compiler: PieceCompiler, weights: list[Weight]) -> Kernel:
        return dequant_blas


class CompiledDequantBlas(PackedCandidate):
    name = "compiled-dequant-blas"

    def make(self, layer: PackedLinear, rows: int, compiler: PieceCompiler, weights: list[Weight]) -> Kernel:
        dequant = Compiled(dequantize_codes, compiler, None, layer.codes, layer.scale, layer.offset)
        return lambda x, c, s, o: nn.functional.linear(x, dequant(c, s, o).view(c.shape[0], -1))


class TiledDequantBlas(PackedCandidate):
    name = "tiled-dequant-blas"

    def applies(self, layer: PackedLinear, rows: int) -> bool:
        return rows > GEMV_ROWS and layer.out_features > TILE_ROWS

    def make(self, layer: PackedLinear, rows: int, compiler: PieceCompiler, weights: list[Weight]) -> Kernel:
        return Tiled(layer, compiler)


class FusedReduction(PackedCandidate):
    name = "fused-reduction"

    def applies(self, layer: PackedLinear, rows: int) -> bool:
        return rows <= GEMV_ROWS

    def make(self, layer: PackedLinear, rows: int, compiler: PieceCompiler, weights: list[Weight]) -> Kernel:
        x = torch.zeros(rows, layer.in_features, dtype=layer.scale.dtype)
        return Compiled(reduction, compiler, rows, x, layer.codes, layer.scale, layer.offset)


class Int4PackMM(PackedCandidate):
    name = "int4pack-mm"

    def applies(self, layer: PackedLinear, rows: int) -> bool:
        """torch's CPU int4 kernel takes 4-bit codes in groups of 32 and float32 or bfloat16 activations."""
        has_op = hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
        return has_op and layer.bits == 4 and layer.group == 32 and layer.scale.dtype in (torch.float32, torch.bfloat16)

    def make(self, layer: PackedLinear, rows: int, compiler: PieceCompiler, weights: list[Weight]) -> Kernel:
        return Int4Packed(weights)


class NativePacked(PackedCandidate):
    name = "native"

    def applies(self, layer: PackedLinear, rows: int) -> bool:
        on_cpu = layer.codes.device.type == "cpu"  # the objects hold CPU kernels only
        return on_cpu and layer.scale.dtype == torch.float32 and native_packed_linear() is not None

    def make(self, layer: PackedLinear, rows: int, compiler: PieceCompiler, weights: list[Weight]) -> Kernel:
        # chosen on an earlier run but not built now (the build logged why): the reference runs
        return native_packed_linear() or dequant_blas


def native_packed_linear() -> Kernel | None:
    """The widest tier's native op this CPU runs (None where none builds)."""
    tiers = runnable_tiers()
    return native_op(tiers[0].name) if tiers else None


CANDIDATES: dict[str, PackedCandidate] = {
    c.name: c
    for c in (DequantBlas(), CompiledDequantBlas(), TiledDequantBlas(), FusedReduction(), Int4PackMM(), NativePacked())
}
DEQUANT_BLAS, COMPILED_DEQUANT, TILED = DequantBlas.name, CompiledDequantBlas.name, TiledDequantBlas.name
FUSED, INT4PACK, NATIVE = FusedReduction.name, Int4PackMM.name, NativePacked.name


def packed_layers(model: nn.Module) -> list[PackedLinear]:
    return [m for m in model.modules() if isinstance(m, PackedLinear)]


def layer_key(layer: PackedLinear) -> dict[str, object]:
    """What a timed choice is for: the layout, the rows timed, and the candidates that can run here (a new
    candidate, row class, or native sources that changed or now build, time the layout again)."""
    dtype = str(layer.scale.dtype).removeprefix("torch.")
    native = source_hash() if native_packed_linear() is not None else None
    return {
        "shape": [layer.out_features, layer.in_features],
        "bits": layer.bits,
        "group": layer.group,
        "dtype": dtype,
        "candidates": sorted(CANDIDATES),
        "rows": list(ROWS),
        "native": native,
    }


def label(layer: PackedLinear) -> str:
    dtype = str(layer.scale.dtype).removeprefix("torch.")
    return f"{layer.out_features}x{layer.in_features} {layer.bits}-bit/{layer.group} {dtype}"


class PackedKernelTable:
    """Timed choices for every distinct packed layer layout of a model; `install` binds the winners."""

    def __init__(self, model: nn.Module, compiler: PieceCompiler, cache: KernelChoiceCache) -> None:
        self.compiler = compiler
        self.layers = packed_layers(model)
        self.distinct = {label(layer): layer for layer in self.layers}
        self.records: dict[str, dict[str, Any]] = {}  # label -> record (for logs and kernel profiles)
        bar = tqdm(self.distinct.items(), desc="Timing packed kernels", unit="layout", leave=False, delay=0.5)
        for name, layer in bar:
            self.records[name] = cache.choose("packed_kernels", layer_key(layer), lambda layer=layer: self._time(layer))

    def winner(self, layer: PackedLinear, rows: int) -> str:
        return str(self.records[label(layer)]["winners"][str(TIMED_ROWS[row_class(rows)])])

    def install(self) -> None:
        """Bind each layer its layout's winners (compiled ones built here, once per layout; repacked weights once
        per layer)."""
        made: dict[tuple[str, str, int], Kernel] = {}
        for layer in self.layers:
            kernels, inline = {}, set()
            for rows in ROWS:
                name = self.winner(layer, rows)
                weight = (layer.codes, layer.scale, layer.offset)
                key = (label(layer), name, rows)
                if name == INT4PACK:  # holds this layer's own repacked codes
                    kernels[row_class(rows)] = CANDIDATES[name].make(layer, rows, self.compiler, [weight])
                    continue
                if key not in made:
                    made[key] = CANDIDATES[name].make(layer, rows, self.compiler, [])
                kernels[row_class(rows)] = made[key]
                if name == FUSED:
                    inline.add(rows)
            layer.use_kernels(kernels, frozenset(inline))

    def _time(self, layer: PackedLinear) -> dict[str, Any]:
        count = stream_count(layer.nbytes, STREAM_BYTES)
        copies = [tuple(t.clone() for t in (layer.codes, layer.scale, layer.offset)) for _ in range(count)]
        times: dict[str, dict[str, float]] = {}
        for rows in ROWS:
            x = torch.randn(rows, layer.in_features, dtype=layer.scale.dtype)
            applying = {name: c for name, c in CANDIDATES.items() if c.applies(layer, rows)}
            kernels = {name: c.make(layer, rows, self.compiler, copies) for name, c in applying.items()}
            times[str(rows)] = time_candidates(kernels, x, copies)
        winners = {rows: min(t, key=t.__getitem__) for rows, t in times.items()}
        return {"winners": winners, "times_us": times}


class Tiled:
    """Dequantize-then-BLAS over TILE_ROWS output rows at a time (one compiled dequantization per tile shape)."""

    def __init__(self, layer: PackedLinear, compiler: PieceCompiler) -> None:
        self.tiles = [
            (start, min(TILE_ROWS, layer.out_features - start)) for start in range(0, layer.out_features, TILE_ROWS)
        ]
        self.dequant = {
            rows: Compiled(
                dequantize_codes, compiler, None, layer.codes[:rows], layer.scale[:rows], layer.offset[:rows]
            )
            for rows in {rows for _, rows in self.tiles}
        }

    def __call__(self, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        outs = []
        for start, rows in self.tiles:
            part = slice(start, start + rows)
            weight = self.dequant[rows](codes[part], scale[part], offset[part]).view(rows, -1)
            outs.append(nn.functional.linear(x, weight))
        return torch.cat(outs, dim=1)


class Int4Packed:
    """torch's CPU int4 kernel over its own copy of each weight's codes in torch's int4 layout (0.5 byte a weight)
    and per group (scale, zero) with w = (q - 8) * scale + zero, so zero = offset + 8 * scale. The weights given
    are repacked up front (as before serving); another is repacked at its first call."""

    def __init__(self, weights: list[Weight]) -> None:
        self.packed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # codes' address -> (repacked codes, pairs)
        for weight in weights:
            self._repacked(*weight)

    def _repacked(self, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, ...]:
        packed = self.packed.get(codes.data_ptr())
        if packed is None:
            q = torch.cat([codes & 15, codes >> 4], dim=-1).reshape(codes.shape[0], -1).to(torch.int32)
            s, o = scale.squeeze(-1), offset.squeeze(-1)
            pairs = torch.stack([s.t(), (o + 8 * s).t()], dim=-1).contiguous()  # [groups, out, 2]
            q4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            packed = self.packed[codes.data_ptr()] = (q4, pairs)
        return packed

    def __call__(self, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        weight, pairs = self._repacked(codes, scale, offset)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight, 32, pairs)


def time_us(kernel: Kernel, x: torch.Tensor, copies: list[tuple], budget_s: float = 0.05) -> float:
    """Mean time per call across the copies of the weight (one sweep, stopped after `budget_s`, so a slow candidate
    costs little time to rule out), in µs."""
    calls, start = 0, time.perf_counter()
    for weight in copies:
        kernel(x, *weight)
        calls += 1
        if time.perf_counter() - start > budget_s:
            break
    return (time.perf_counter() - start) / calls * 1e6


def time_candidates(kernels: dict[str, Kernel], x: torch.Tensor, copies: list[tuple], rounds: int = 3) -> dict:
    """Each candidate's best sweep over `rounds` rounds, the candidates taking turns within a round: a burst of
    other work on the machine slows one sweep of one candidate, not a candidate's every sweep."""
    for kernel in kernels.values():
        kernel(x, *copies[0])  # warm-up (first-call allocations, lazy repacking)
    best = dict.fromkeys(kernels, float("inf"))
    for _ in range(rounds):
        for name, kernel in kernels.items():
            best[name] = min(best[name], time_us(kernel, x, copies))
    return {name: round(us, 2) for name, us in best.items()}
