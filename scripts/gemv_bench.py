"""Weight products of SmolLM2-135M at 1, 2 and 4 rows: MKL (row- and column-major weights) vs the inductor
reduction kiln's DecodeGemv pass emits for static one/two-row pieces (inductor keeps BLAS from 3 rows).

Usage: .venv/bin/python scripts/gemv_bench.py [--rows 1,2,4]
Prints, per row count, the time of the 30 decoder layers' products (+ the 49152x576 head) and GB/s streamed.
Weights rotate over copies larger than the L3 cache, so every product reads DRAM as in a real decode step.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from kiln.compile.passes import KilnPostGradPasses

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # [out, in]: qkv, o, gate_up, down
HEAD_SHAPE = (49152, 576)
NUM_LAYERS = 30


def _time(fn: Callable[[], object], reps: int = 50) -> float:
    for _ in range(5):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def _rotating(weights: list[torch.Tensor]) -> Callable[[], torch.Tensor]:
    state = {"i": 0}

    def next_weight() -> torch.Tensor:
        state["i"] = (state["i"] + 1) % len(weights)
        return weights[state["i"]]

    return next_weight


def _reduction() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.mm(x, w.t())

    torch._dynamo.reset()  # one fresh compile per shape, never dynamo's recompile limit (eager fallback)
    options = {"post_grad_custom_post_pass": KilnPostGradPasses()}
    return torch.compile(product, dynamic=False, fullgraph=True, options=options)


def _bench_shape(rows: int, shape: tuple[int, int]) -> dict[str, float]:
    """Seconds per product of `rows` rows with an [out, in] weight, per implementation."""
    copies = max(2, int(128e6 // (shape[0] * shape[1] * 4)))
    row_major = [torch.randn(shape) for _ in range(copies)]
    col_major = [w.t().contiguous().t() for w in row_major]
    x = torch.randn(rows, shape[1])
    compiled = _reduction()
    torch.testing.assert_close(compiled(x, row_major[0]), x @ row_major[0].t(), rtol=1e-4, atol=1e-4)
    nxt_row, nxt_col = _rotating(row_major), _rotating(col_major)
    return {
        "mkl row-major": _time(lambda: x @ nxt_row().t()),
        "mkl column-major": _time(lambda: x @ nxt_col().t()),
        "inductor + kiln passes": _time(lambda: compiled(x, nxt_row())),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for rows in (int(r) for r in args.rows.split(",")):
        totals: dict[str, float] = {}
        total_bytes = 0
        for shape in [*LAYER_SHAPES, HEAD_SHAPE]:
            repeat = 1 if shape == HEAD_SHAPE else NUM_LAYERS
            for name, seconds in _bench_shape(rows, shape).items():
                totals[name] = totals.get(name, 0.0) + seconds * repeat
            total_bytes += shape[0] * shape[1] * 4 * repeat
        cells = ", ".join(f"{k} {v * 1e3:.1f} ms ({total_bytes / v / 1e9:.1f} GB/s)" for k, v in totals.items())
        print(f"rows={rows}: {cells}")


if __name__ == "__main__":
    main()
