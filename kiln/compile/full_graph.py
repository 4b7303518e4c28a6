"""The full decode graph: the whole forward of a decode-only step, attention included, as one graph.

vLLM's FULL cudagraph for decode batches, built the kiln way: the forward is traced once more with the forward
context's `DecodeInputs` set, so attention is the traced decode attention of kiln.model.graph_attention (no
opaque op, `fullgraph=True`), and the graph's positions input is replaced by positions derived from the
persistent `seq_lens`. The graph is compiled in layer units (kiln.compile.decode_units: one compile per distinct
decoder layer, as identical pieces are) through the compiled-piece store, for a symbolic num_tokens and table
width, so no size and no context length ever recompiles. Per step, `DecodeBuffers` takes the step's inputs in one
copy, and the graph runs on its views:
- CUDA: one CUDA graph per capture size, recorded over those views at the captured table width;
- CPU (no CUDA graphs): the compiled graph called on the same persistent views, at the step's table width.

It is a `Piece` (kiln.compile.piece), so it has the pieces' modes (`eager` runs the traced graph op by op, the
debugger's reference), hooks and rewrites (taps, faults), and trace-mode logging. It keeps the pieces' contract
too: `checked_code` hands its layer units' generated code to the fusion check (kiln.compile.fusion_check), and the
artifacts write its IR, code and kernel profile (kiln.compile.artifacts).
"""

from __future__ import annotations

import logging
import math
from functools import partial
from typing import Any

import torch
from torch import nn

from kiln.compile.backend import (
    BLOCK_TABLE,
    INPUT_IDS,
    NUM_BLOCKS,
    NUM_TOKENS,
    POSITIONS,
    SEQ_LENS,
    WINDOW_TABLE,
    TracedForward,
)
from kiln.compile.capture import make_capture
from kiln.compile.counters import CompileCounters
from kiln.compile.decode_buffers import DecodeBuffers
from kiln.compile.decode_units import LayerUnits
from kiln.compile.fusion_match import CheckedCode
from kiln.compile.modes import PieceMode
from kiln.compile.piece import Piece
from kiln.compile.split import SplitPiece, module_paths, structure_key
from kiln.compile.stamp import trace_model
from kiln.compile.store import CompiledPieceStore
from kiln.model.attention import cache_nulls, kv_cache_block_size
from kiln.model.forward_context import DecodeInputs, DecodeKernel, ModelInputs
from kiln.platforms import platform_of
from kiln.quant.linear import PackedLinear

logger = logging.getLogger("kiln")

FULL_LABEL = "full decode graph"


def derive_positions(traced: TracedForward) -> None:
    """Replace the graph's `positions` input with positions derived from the persistent `seq_lens` (in place)."""
    gm, slots = traced.gm, traced.slots
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if POSITIONS not in slots:
        return
    pos, lens = placeholders[slots.index(POSITIONS)], placeholders[slots.index(SEQ_LENS)]
    # NOTE: decode_positions (kiln.model.graph_attention) as torch calls: AOT autograd caches known targets only
    with gm.graph.inserting_after(placeholders[-1]):
        clamped = gm.graph.call_function(torch.clamp, (lens,), {"min": 1})
    with gm.graph.inserting_after(clamped):
        derived = gm.graph.call_function(torch.sub, (clamped, 1))
    clamped.meta, derived.meta = dict(pos.meta), dict(pos.meta)
    pos.replace_all_uses_with(derived)
    gm.graph.erase_node(pos)
    gm.recompile()
    i = slots.index(POSITIONS)
    del traced.slots[i], traced.bound[i]


class DecodeVariant:
    """One traced full decode graph (for any num_tokens, or one static size) as a Piece."""

    def __init__(self, traced: TracedForward, counters: CompileCounters, static_size: int | None) -> None:
        derive_positions(traced)
        self.traced, self.static_size = traced, static_size
        self.units: LayerUnits | None = None  # set by compiling
        gm = traced.gm
        table = traced.slots.index(BLOCK_TABLE)
        self.piece = Piece(
            SplitPiece(
                index=0,
                submod_name="full_decode",
                graph=gm,
                structure_key=structure_key(gm),
                module_paths=module_paths(gm),
            ),
            counters,
            label=FULL_LABEL + ("" if static_size is None else f" (num_tokens={static_size})"),
            size_slot=traced.slots.index(NUM_TOKENS) if static_size is None else None,
            # CUDA graphs are captured per (num_tokens, table width) (DecodeBuffers.widths)
            capture_key=lambda piece, args: (piece.num_tokens(args), args[table].shape[1]),
        )

    def args(self, ids: torch.Tensor, decode: DecodeInputs, size: int, width: int) -> list[Any]:
        values = {
            INPUT_IDS: ids,
            SEQ_LENS: decode.seq_lens,
            BLOCK_TABLE: decode.block_table,
            WINDOW_TABLE: decode.window_table,
            NUM_TOKENS: size,
            NUM_BLOCKS: width,
        }
        return self.traced.args_for(values)


def max_table_width(window: int, num_blocks: int, block_size: int, max_model_len: int | None) -> int:
    """Blocks in the widest block table of a decode step: a sequence holds at most the pool's blocks, but under a
    sliding window on every layer its released entries stay in the table (as the null block,
    kiln.engine.scheduling.kv_window), so only `max_model_len` bounds the width (None: the pool's blocks, wider steps
    run the pieces)."""
    if not max_model_len:
        return num_blocks
    width = math.ceil(max_model_len / block_size)
    return width if window else min(num_blocks, width)


class FullDecodeGraph:
    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[torch.Tensor],
        device: torch.device,
        counters: CompileCounters,
        sizes: list[int],
        max_model_len: int | None,
        sample_size: int,
        gemv_sizes: tuple[int, ...] = (),
        decode_kernel: DecodeKernel | None = None,
    ) -> None:
        """`gemv_sizes`: the static compile sizes the kernel choice kept (fp32 weight products as GEMV reductions,
        kiln.compile.passes.DecodeGemv): each gets a static-size graph too. `decode_kernel`: the plan's decode
        attention (None: the torch form), traced into every graph."""
        self.device = device
        self.counters = counters
        self.sizes = sorted(sizes)
        trace = partial(
            trace_model, model, kv_caches, device, sample_size=sample_size, decode=True, decode_kernel=decode_kernel
        )
        self.variants: dict[int | None, DecodeVariant] = {None: DecodeVariant(trace(), counters, None)}
        counters.graphs_traced += 1
        for size in static_sizes(model, self.sizes, gemv_sizes):
            self.variants[size] = DecodeVariant(trace(static_size=size), counters, size)
            counters.graphs_traced += 1
        nulls = cache_nulls(model.config, kv_caches)
        block_size, blocks = kv_cache_block_size(kv_caches[0]), nulls[0]  # the null block is the last: id = blocks
        max_blocks = max_table_width(model.config.uniform_sliding_window, blocks, block_size, max_model_len)
        self.buffers = DecodeBuffers(self.sizes[-1], max_blocks, nulls, device)

    @property
    def pieces(self) -> list[Piece]:
        return [v.piece for v in self.variants.values()]

    @property
    def piece(self) -> Piece:
        """The graph for any num_tokens (static-size variants beside it: `pieces`)."""
        return self.variants[None].piece

    @property
    def mode(self) -> PieceMode:
        return self.piece.mode

    def variant(self, size: int) -> DecodeVariant:
        return self.variants.get(size) or self.variants[None]

    def compile(self, store: CompiledPieceStore) -> None:
        """Each variant in layer units (kiln.compile.decode_units): one compile per distinct decoder layer."""
        for v in self.variants.values():
            piece = v.piece
            if piece.compiled is None:
                v.units = LayerUnits(piece.compile_source)
                piece.set_compiled(v.units.compile(store, f"the {piece.label}", piece.persistent))
                units = v.units.units
                logger.info("The %s runs %d layer units (%d distinct)", piece.label, len(units), v.units.distinct)

    def set_mode(self, mode: PieceMode, store: CompiledPieceStore, pool: Any) -> None:
        """Eager (the traced graph op by op), compiled, or captured (CUDA graphs per size; on CPU, compiled on the
        persistent buffers)."""
        if mode is not PieceMode.EAGER:
            self.compile(store)
        for piece in self.pieces:
            piece.set_mode(mode)
        if mode is PieceMode.CAPTURED and platform_of(self.device).records_graphs and not self.piece.captures:
            self._capture(pool)

    def _capture(self, pool: Any) -> None:
        """One CUDA graph per capture size and table width bucket, widest and largest first (they share a pool)."""
        widths = self.buffers.widths
        for width in reversed(widths):
            for size in reversed(self.sizes):
                v = self.variant(size)
                compiled = v.piece.compiled
                assert compiled is not None
                args = v.args(*self.buffers.views(size, width), size, width)
                capture = make_capture(self.device, compiled.fn, args, dynamic_args=[], adopt=set(), pool=pool)
                v.piece.add_capture((size, width), capture)
                self.counters.full_graphs_captured += 1
        logger.info(
            "Capturing full decode graphs (sizes %s x table widths %s blocks, avail_mem=%.2f GB): 100%%",
            self.sizes,
            widths,
            platform_of(self.device).available_memory_gb(self.device),
        )

    def checked_code(self) -> list[CheckedCode]:
        """What the fusion check reads: each layer unit of the graph for any num_tokens with its generated code and
        the static-size graphs' code of the same unit; uncompiled (eager), the whole graph without code."""
        dynamic = self.variants[None]
        piece, units = dynamic.piece, dynamic.units
        if piece.compiled is None or units is None:
            return [
                CheckedCode(index=0, label=FULL_LABEL, graph=piece.compile_source, source=None, mode=piece.mode.value)
            ]
        codes = []
        for i, (_, graph) in enumerate(units.units):
            static = {
                size: source
                for size, v in self.variants.items()
                if size is not None and v.units is not None and (source := v.units.sources[i])
            }
            codes.append(
                CheckedCode(
                    index=i,
                    label=f"{FULL_LABEL}, layer unit {i + 1}/{len(units.units)}",
                    graph=graph,
                    source=units.sources[i],
                    mode=piece.mode.value,
                    static_sources=static,
                )
            )
        return codes

    def fits(self, batch: ModelInputs, size: int) -> bool:
        return size in self.sizes and self.buffers.fits(batch.metadata)

    def run(self, batch: ModelInputs, size: int) -> torch.Tensor:
        """Hidden states [size, hidden] of a decode-only step padded to capture size `size`."""
        ids, decode, width = self.buffers.load(batch, size)
        v = self.variant(size)
        out = v.piece(*v.args(ids, decode, size, width))
        return out[0] if v.piece.returns_tuple else out


# NOTE: each static variant is one more trace and set of layer units to compile (cached after): for packed
# products only batch-1 decode, where ~120 op calls a step cost as much as a fifth of it, gets one
STATIC_SIZES = (1,)


def static_sizes(model: nn.Module, sizes: list[int], gemv_sizes: tuple[int, ...] = ()) -> list[int]:
    """Capture sizes that get a decode graph of their own: the timed GEMV sizes, and those of STATIC_SIZES at which
    some packed decoder product's timed winner is the fused reduction, which a static-size trace writes inline
    (`PackedLinear.inline_rows`)."""
    # NOTE: the decoder's layers only: the logits head runs outside the decode graph, so its winner adds no variant
    inlined = {rows for m in model.model.layers.modules() if isinstance(m, PackedLinear) for rows in m.inline_rows}
    return [size for size in sizes if (size in inlined and size in STATIC_SIZES) or size in gemv_sizes]
