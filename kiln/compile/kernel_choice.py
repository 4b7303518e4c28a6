"""Graph mode's CPU kernel choice: which small row counts run their weight products as GEMV reductions.

For pieces compiled for a static one- or two-token batch, the DecodeGemv pass can turn every weight product into
a vectorized reduction (kiln.compile.passes), which needs row-major weights; otherwise the products stay BLAS
calls, in whichever layout BLAS streams faster. Which is faster depends on the machine: on one 2-core AVX-512
box the reductions took 42.5 ms per decode step against MKL's 24.3 ms, on another 21.2 against 44.9. So the
executor times, on the model's largest decoder weight streamed from DRAM: BLAS row-major, BLAS column-major and
the compiled reduction, for one row and for two, and caches the result per machine (kiln.executor.kernel_choice).

Rule: static size 1 when the reduction beats both BLAS layouts at one row (batch-1 decode is the case it is for);
then static size 2 too when the reduction beats row-major BLAS at two rows (the layout is row-major by then).
Without static sizes the weights take the faster BLAS layout for one row.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kiln.compile.compiler import PieceCompiler, make_compiler
from kiln.compile.logits_head import CompiledProduct, product_graph
from kiln.compile.packed_kernels import packed_layers, time_and_install
from kiln.compile.passes import GEMV_MAX_ROWS
from kiln.executor.kernel_choice import KernelChoiceCache, streamed_copies, time_per_call_us
from kiln.executor.layout import (
    COLUMN_MAJOR,
    LAYOUTS,
    ROW_MAJOR,
    fastest_one_row_layout,
    largest_layer_weight,
    one_row_head,
    set_layer_weight_layout,
    weight_key,
    with_layout,
)

logger = logging.getLogger("kiln")

REDUCTION = "gemv-reduction"


@dataclass
class Kernels:
    static_sizes: tuple[int, ...]  # capture sizes also compiled for their static num_tokens
    choices: dict[str, dict[str, object]]  # what was timed (or read from the cache), for logs and kernel_profile.json
    head_t: torch.Tensor | None = None  # [hidden, vocab] head copy for one-row logits, when BLAS gains that way


def choose_kernels(
    model: nn.Module,
    configured_sizes: Sequence[int] | None,
    capture_sizes: list[int],
    compiler: PieceCompiler,
    cache_root: Path,
) -> Kernels:
    """The static compile sizes (configured, or timed) and, on CPU, the decoder weight layout (applied to `model`)
    and one-row logits head that go with them."""
    cpu = next(model.parameters()).device.type == "cpu"
    cache = KernelChoiceCache(cache_root)
    choices: dict[str, dict[str, object]] = {}
    weight = largest_layer_weight(model)
    if cpu and packed_layers(model):  # their one- and two-row choices live in the op: no static sizes for them
        table_compiler = compiler if compiler.supports_static_sizes else make_compiler("inductor")
        choices["packed_kernels"] = time_and_install(model, table_compiler, cache)
    if configured_sizes is not None:
        sizes = tuple(sorted(configured_sizes))
    elif weight is None:
        sizes = ()
    elif cpu and compiler.supports_static_sizes:
        record = choose_static_sizes(weight, capture_sizes, compiler, cache)
        choices["static_sizes"] = record
        sizes = tuple(int(s) for s in list(record["static_sizes"]))
    else:
        sizes = ()
    if not cpu:
        return Kernels(sizes, choices)
    gemv_sizes = [s for s in sizes if s <= GEMV_MAX_ROWS]
    if weight is None:
        layout = "packed"  # no float decoder weight: nothing to lay out
    elif gemv_sizes:
        layout = ROW_MAJOR  # DecodeGemv reduces over row-major weights
    else:
        choices["decoder_layout"] = fastest_one_row_layout(weight, cache)
        layout = str(choices["decoder_layout"]["winner"])
    if weight is not None:
        set_layer_weight_layout(model, layout)
    head_t = None
    if 1 not in sizes and isinstance(model.lm_head, nn.Linear):
        head_t, choices["lm_head"] = one_row_head(model.lm_head.weight, cache)
    timed = any(c.get("source") == "timed" for c in choices.values())
    logger.info(
        "Graph mode CPU kernels (%s): static compile sizes %s (GEMV reductions for %s rows), decoder weights %s",
        "timed" if timed else "timed earlier on this machine" if choices else "configured",
        list(sizes) or "none",
        gemv_sizes or "no",
        layout,
    )
    return Kernels(sizes, choices, head_t)


def choose_static_sizes(
    weight: torch.Tensor, capture_sizes: list[int], compiler: PieceCompiler, cache: KernelChoiceCache
) -> dict[str, object]:
    """{"static_sizes", "layout", "times_us": {rows: {candidate: µs}}, "source"} for `weight`'s shape."""
    rows_to_time = [r for r in range(1, GEMV_MAX_ROWS + 1) if r in capture_sizes]

    def measure() -> dict[str, object]:
        times = {str(rows): _time_candidates(weight, rows, compiler) for rows in rows_to_time}
        return {**decide(times), "times_us": times}

    return cache.choose("decode_gemv", {**weight_key(weight), "rows": rows_to_time}, measure)


def decide(times: dict[str, dict[str, float]]) -> dict[str, object]:
    """The rule in the module docstring, over measured times (µs per product) by row count and candidate."""
    one = times.get("1")
    if one is None or one[REDUCTION] >= min(one[ROW_MAJOR], one[COLUMN_MAJOR]):
        layout = ROW_MAJOR if one is None or one[ROW_MAJOR] <= one[COLUMN_MAJOR] else COLUMN_MAJOR
        return {"static_sizes": [], "layout": layout}
    sizes = [1] + [int(r) for r, t in times.items() if r != "1" and t[REDUCTION] < t[ROW_MAJOR]]
    return {"static_sizes": sorted(sizes), "layout": ROW_MAJOR}


def _time_candidates(weight: torch.Tensor, rows: int, compiler: PieceCompiler) -> dict[str, float]:
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
    times = {}
    for layout in LAYOUTS:
        copies = streamed_copies(weight, lambda w, layout=layout: with_layout(w, layout))
        times[layout] = time_per_call_us(lambda w: torch.nn.functional.linear(x, w), copies)
    row_major = with_layout(weight.detach(), ROW_MAJOR)
    graph = product_graph(row_major, rows)
    product = CompiledProduct(compiler.compile(graph, rows), graph, row_major)
    copies = streamed_copies(weight, lambda w: with_layout(w, ROW_MAJOR))
    times[REDUCTION] = time_per_call_us(lambda w: product(x, w), copies)
    return {k: round(v, 2) for k, v in times.items()}
