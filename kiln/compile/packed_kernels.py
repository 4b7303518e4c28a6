"""The kernel table of packed products (`torch.ops.kiln.packed_linear`, kiln.quant.ops): for every packed layer
layout the model uses and every row count the table covers, candidate kernels are timed on this machine, over
copies of the weight streamed from DRAM, and the winner is cached per machine (kiln.executor.kernel_choice) and
registered for the op. Nothing is assumed from the box the code was written on.

Candidates for `x [rows, in] @ W.T`, W packed as codes, scales and offsets per group:
- `dequant-blas`: W dequantized by torch ops, then the BLAS product (the reference);
- `compiled-dequant-blas`: W dequantized by one inductor kernel, then the BLAS product;
- `tiled-dequant-blas` (more than 2 rows, more than TILE_ROWS outputs): the same, TILE_ROWS output rows at a time,
  so each dequantized tile is still in cache when BLAS reads it (the logits head at batch 32: 20 ms against 70 ms
  dequantized whole and 27 ms for the float32 head, measured on a 2-core EPYC);
- `fused-reduction` (1 and 2 rows): the product as one reduction over the codes (kiln.quant.ops.reduction),
  compiled for the static row count, so the weight streams at its packed width and is never written out;
- `int4pack-mm` (4-bit codes in groups of 32, where this torch has the op): torch's CPU int4 kernel over a copy
  of the codes repacked into its layout.
Rows timed: 1, 2 and MANY_ROWS, which stands for every count above 2 (prefill chunks and batched decode).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from kiln.compile.compiler import PieceCompiler
from kiln.compile.logits_head import trace_static
from kiln.executor.kernel_choice import KernelChoiceCache, stream_count
from kiln.quant.linear import PackedLinear
from kiln.quant.ops import (
    GEMV_ROWS,
    INLINE,
    KERNELS,
    MANY,
    Kernel,
    dequant_blas,
    dequantize_codes,
    kernel_key,
    reduction,
)

logger = logging.getLogger("kiln")

DEQUANT_BLAS, COMPILED_DEQUANT, TILED = "dequant-blas", "compiled-dequant-blas", "tiled-dequant-blas"
FUSED, INT4PACK = "fused-reduction", "int4pack-mm"
TILE_ROWS = 2048  # output rows dequantized at a time by TILED: a tile stays in cache for its product
MANY_ROWS = 32
STREAM_BYTES = 96 << 20  # copies of a layer that add up to more than a last-level cache
ROWS = (*range(1, GEMV_ROWS + 1), MANY_ROWS)


def packed_layers(model: nn.Module) -> list[PackedLinear]:
    return [m for m in model.modules() if isinstance(m, PackedLinear)]


def layer_key(layer: PackedLinear) -> dict[str, object]:
    dtype = str(layer.scale.dtype).removeprefix("torch.")
    return {"shape": [layer.out_features, layer.in_features], "bits": layer.bits, "group": layer.group, "dtype": dtype}


def label(layer: PackedLinear) -> str:
    dtype = str(layer.scale.dtype).removeprefix("torch.")
    return f"{layer.out_features}x{layer.in_features} {layer.bits}-bit/{layer.group} {dtype}"


class PackedKernelTable:
    """Timed choices for every distinct packed layer layout of a model; `install` registers the winners."""

    def __init__(self, model: nn.Module, compiler: PieceCompiler, cache: KernelChoiceCache) -> None:
        self.compiler = compiler
        self.distinct = {label(layer): layer for layer in packed_layers(model)}
        self.records: dict[str, dict[str, Any]] = {}  # label -> record (for logs and kernel profiles)
        bar = tqdm(self.distinct.items(), desc="Timing packed kernels", unit="layout", leave=False, delay=0.5)
        for name, layer in bar:
            self.records[name] = cache.choose("packed_kernels", layer_key(layer), lambda layer=layer: self._time(layer))

    def winner(self, layer: PackedLinear, rows: int) -> str:
        return str(self.records[label(layer)]["winners"][str(rows if rows <= GEMV_ROWS else MANY_ROWS)])

    def install(self) -> None:
        """Register each layout's winners for `torch.ops.kiln.packed_linear` (compiled ones built here)."""
        _INT4PACKED.clear()  # repacked codes are keyed by address: none may outlive the engine that made them
        for layer in self.distinct.values():
            for rows in ROWS:
                name = self.winner(layer, rows)
                key = kernel_key(layer.codes, layer.scale, rows if rows <= GEMV_ROWS else MANY)
                KERNELS[key] = self._make(name, layer, rows)
                (INLINE.add if name == FUSED else INLINE.discard)(key)

    def _make(self, name: str, layer: PackedLinear, rows: int) -> Kernel:
        if name == FUSED:
            x = torch.zeros(rows, layer.in_features, dtype=layer.scale.dtype)
            return Compiled(reduction, self.compiler, rows, x, layer.codes, layer.scale, layer.offset)
        if name == COMPILED_DEQUANT:
            dequant = Compiled(dequantize_codes, self.compiler, None, layer.codes, layer.scale, layer.offset)
            return lambda x, c, s, o: nn.functional.linear(x, dequant(c, s, o).view(c.shape[0], -1))
        if name == INT4PACK:
            return int4pack_mm
        if name == TILED:
            return Tiled(layer, self.compiler)
        return dequant_blas

    def _time(self, layer: PackedLinear) -> dict[str, Any]:
        count = stream_count(layer.nbytes, STREAM_BYTES)
        copies = [tuple(t.clone() for t in (layer.codes, layer.scale, layer.offset)) for _ in range(count)]
        names = [DEQUANT_BLAS, COMPILED_DEQUANT]
        if int4pack_supported(layer):
            names.append(INT4PACK)
            for weight in copies:  # repacked before timing, as installed kernels are before serving
                int4pack_weights(*weight)
        times: dict[str, dict[str, float]] = {}
        for rows in ROWS:
            x = torch.randn(rows, layer.in_features, dtype=layer.scale.dtype)
            extra = [FUSED] if rows <= GEMV_ROWS else [TILED] if layer.out_features > TILE_ROWS else []
            kernels = {name: self._make(name, layer, rows) for name in names + extra}
            times[str(rows)] = time_candidates(kernels, x, copies)
        _INT4PACKED.clear()
        winners = {rows: min(t, key=t.__getitem__) for rows, t in times.items()}
        return {"winners": winners, "times_us": times}


class Compiled:
    """`fn(*args)` compiled by the piece compiler for these shapes, called with its inputs in dynamo's order."""

    def __init__(self, fn: Callable[..., torch.Tensor], compiler: PieceCompiler, rows: int | None, *args) -> None:
        graph = trace_static(lambda *a: (fn(*a),), *args)
        self.fn = compiler.compile(graph, rows).fn
        shapes = [tuple(a.shape) for a in args]
        placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
        # NOTE: dynamo orders a graph's inputs its own way; match them to the arguments by name (L_a_0_, ...)
        self.order = [int(n.target.rstrip("_").rsplit("_", 1)[-1]) for n in placeholders]
        assert [shapes[i] for i in self.order] == [tuple(n.meta["example_value"].shape) for n in placeholders]

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        return self.fn(*map(args.__getitem__, self.order))[0]


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


def int4pack_supported(layer: PackedLinear) -> bool:
    """torch's CPU int4 kernel takes 4-bit codes in groups of 32 and float32 or bfloat16 activations."""
    has_op = hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
    return has_op and layer.bits == 4 and layer.group == 32 and layer.scale.dtype in (torch.float32, torch.bfloat16)


_INT4PACKED: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # codes' data_ptr -> (repacked codes, pairs)


def int4pack_weights(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The codes repacked once into torch's int4 layout (a copy, 0.5 byte per weight) and per group (scale, zero)
    with w = (q - 8) * scale + zero, so zero = offset + 8 * scale."""
    packed = _INT4PACKED.get(codes.data_ptr())
    if packed is None:
        q = torch.cat([codes & 15, codes >> 4], dim=-1).reshape(codes.shape[0], -1).to(torch.int32)
        s, o = scale.squeeze(-1), offset.squeeze(-1)
        pairs = torch.stack([s.t(), (o + 8 * s).t()], dim=-1).contiguous()  # [groups, out, 2]
        packed = _INT4PACKED[codes.data_ptr()] = (torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), pairs)
    return packed


def int4pack_mm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    weight, pairs = int4pack_weights(codes, scale, offset)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight, 32, pairs)


def time_and_install(model: nn.Module, compiler: PieceCompiler, cache: KernelChoiceCache) -> dict[str, Any]:
    """Time (or read) the table for the model's packed layers, register the winners, log them; the records."""
    table = PackedKernelTable(model, compiler, cache)
    table.install()
    timed = any(r.get("source") == "timed" for r in table.records.values())
    logger.info(
        "Packed kernels (%s): %s",
        "timed" if timed else "timed earlier on this machine",
        "; ".join(
            f"{name}: "
            + ", ".join(f"{'many' if r == str(MANY_ROWS) else r} rows {w}" for r, w in rec["winners"].items())
            for name, rec in table.records.items()
        ),
    )
    return table.records
