"""Which small row counts graph mode compiles for their static shape, so their weight products run as GEMV
reductions (one part of the kernel plan, kiln.kernels.plan).

For pieces compiled for a static one- or two-token batch, the DecodeGemv pass can turn every weight product into
a vectorized reduction (kiln.compile.passes), which needs row-major weights; otherwise the products stay BLAS
calls, in whichever layout BLAS streams faster. Which is faster depends on the machine: on one 2-core AVX-512
box the reductions took 42.5 ms per decode step against MKL's 24.3 ms, on another 21.2 against 44.9. So the
plan times, on the model's largest decoder weight streamed from DRAM: BLAS row-major, BLAS column-major and
the compiled reduction, for one row and for two, and caches the result per machine (kiln.kernels.choices).

Rule: static size 1 when the reduction beats both BLAS layouts at one row (batch-1 decode is the case it is for),
and oneDNN's product on a prepacked copy where that runs (bf16, kiln.kernels.dense); then static size 2 too when the
reduction beats row-major BLAS (and the prepacked product) at two rows (the layout is row-major by then).
Without static sizes the weights take the faster BLAS layout for one row.
"""

from __future__ import annotations

from math import inf

import torch

from kiln.compile.compiler import PieceCompiler
from kiln.compile.passes import GEMV_MAX_ROWS
from kiln.kernels.choices import KernelChoiceCache, streamed_copies, time_per_call_us
from kiln.kernels.dense import PREPACKED, Prepacked, prepacking_runs
from kiln.kernels.layout import COLUMN_MAJOR, LAYOUTS, ROW_MAJOR, weight_key, with_layout
from kiln.kernels.product import CompiledProduct, product_graph

REDUCTION = "gemv-reduction"


def choose_static_sizes(
    weight: torch.Tensor, capture_sizes: list[int], compiler: PieceCompiler, cache: KernelChoiceCache
) -> dict[str, object]:
    """{"static_sizes", "layout", "times_us": {rows: {candidate: µs}}, "source"} for `weight`'s shape."""
    rows_to_time = [r for r in range(1, GEMV_MAX_ROWS + 1) if r in capture_sizes]

    def measure() -> dict[str, object]:
        times = {str(rows): _time_candidates(weight, rows, compiler) for rows in rows_to_time}
        return {**decide(times), "times_us": times}

    key = {**weight_key(weight), "rows": rows_to_time}
    if prepacking_runs(weight):
        key["candidates"] = [ROW_MAJOR, COLUMN_MAJOR, PREPACKED, REDUCTION]
    return cache.choose("decode_gemv", key, measure)


def decide(times: dict[str, dict[str, float]]) -> dict[str, object]:
    """The rule in the module docstring, over measured times (µs per product) by row count and candidate."""
    one = times.get("1")
    if one is None or one[REDUCTION] >= min(one[ROW_MAJOR], one[COLUMN_MAJOR], one.get(PREPACKED, inf)):
        layout = ROW_MAJOR if one is None or one[ROW_MAJOR] <= one[COLUMN_MAJOR] else COLUMN_MAJOR
        return {"static_sizes": [], "layout": layout}
    sizes = [1] + [
        int(r) for r, t in times.items() if r != "1" and t[REDUCTION] < min(t[ROW_MAJOR], t.get(PREPACKED, inf))
    ]
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
    if prepacking_runs(weight):  # oneDNN on its own copy of each weight (kiln.kernels.dense), made before timing
        prepacked = Prepacked()
        for w in copies:
            prepacked.pack(w)
        times[PREPACKED] = time_per_call_us(lambda w: prepacked(x, w), copies)
    return {k: round(v, 2) for k, v in times.items()}
