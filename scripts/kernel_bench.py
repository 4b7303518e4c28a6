"""kiln's native packed products on the default model's layouts, every ISA tier this CPU runs, side by side: float32
activations (`packed_linear`), one int8 digit (`packed_linear_q8`, llama.cpp's q8 arithmetic) and two
(`packed_linear_q8x2`, the default), their blocked forms where the tier has them (`*_blocked`: 16 outputs a vector
on AVX-512 VNNI, 8 on AVX2 for 4-bit codes; `*_streamed`: the same, transposed in registers), with the timed table's
best torch candidate for scale (dequantize-then-BLAS).

Usage: .venv/bin/python scripts/kernel_bench.py [--rows 1,2,16,64,256] [--tiers avx512,avx2]
Prints µs per call (best of 5 sweeps over weight copies larger than the LLC, so codes stream from DRAM), GB/s of
codes + scales + offsets streamed, and GOPS (2 x rows x out x in per call).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from kiln.kernels.choices import stream_count
from kiln.kernels.native.build import native_op, runnable_tiers
from kiln.kernels.packed import STREAM_BYTES
from kiln.quant.gguf_blocks import decode_blocks
from kiln.quant.ops import dequant_blas

LAYOUTS = [  # (name, out, in, GGUF type): the default model's packed layers
    ("qkv 960x576 Q4_1", 960, 576, GGMLQuantizationType.Q4_1),
    ("o 576x576 Q4_1", 576, 576, GGMLQuantizationType.Q4_1),
    ("gate_up 3072x576 Q4_1", 3072, 576, GGMLQuantizationType.Q4_1),
    ("down 576x1536 Q4_1", 576, 1536, GGMLQuantizationType.Q4_1),
    ("head 49152x576 Q8_0", 49152, 576, GGMLQuantizationType.Q8_0),
]
OPS = {
    "float32": "packed_linear",
    "int8": "packed_linear_q8",
    "int8x2": "packed_linear_q8x2",
    "int8-blocked": "packed_linear_q8_blocked",
    "int8x2-blocked": "packed_linear_q8x2_blocked",
    "int8-streamed": "packed_linear_q8_streamed",
    "int8x2-streamed": "packed_linear_q8x2_streamed",
    "int8-wide": "packed_linear_q8_wide",
    "int8x2-wide": "packed_linear_q8x2_wide",
}


def best_us(kernel, x: torch.Tensor, copies: list[tuple]) -> float:
    kernel(x, *copies[0])
    best = float("inf")
    for _ in range(5):
        start, calls = time.perf_counter(), 0
        for weight in copies:
            kernel(x, *weight)
            calls += 1
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,16,64,256")
    parser.add_argument("--tiers", default=",".join(t.name for t in runnable_tiers() if t.name != "plain"))
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name, out, inp, kind in LAYOUTS:
        raw = quantize(np.random.default_rng(0).standard_normal((out, inp)).astype(np.float32), kind)
        weight = tuple(torch.from_numpy(a) for a in decode_blocks(raw, kind, out, inp))
        nbytes = sum(t.numel() * t.element_size() for t in weight)
        copies = [tuple(t.clone() for t in weight) for _ in range(stream_count(nbytes, STREAM_BYTES))]
        for rows in rows_list:
            x = torch.randn(rows, inp)
            cells = [f"dequant-blas {best_us(dequant_blas, x, copies):.0f}"]
            for tier in args.tiers.split(","):
                for activations, op_name in OPS.items():
                    op = native_op(tier, op_name)
                    if op is None:
                        continue
                    try:
                        us = best_us(op, x, copies)
                    except RuntimeError:  # the AVX2 blocked form takes 4-bit codes only
                        cells.append(f"{tier}/{activations} n/a")
                        continue
                    gops = 2 * rows * out * inp / us / 1e3
                    cells.append(f"{tier}/{activations} {us:.0f} ({nbytes / us / 1e3:.1f} GB/s, {gops:.0f} GOPS)")
            print(f"{name}, {rows} rows: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
