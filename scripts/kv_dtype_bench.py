"""Decode attention over each KV cache dtype: kiln's native paged kernel (the widest tier this CPU runs) on one
layer of SmolLM2-135M's shape (9 query heads, 3 KV heads, head_dim 64, 16-token blocks), one decode row per
sequence, best of several runs; then the ratio to float32. What `--kv-cache-dtype auto` picks for a float32 model
(kiln.config.AUTO_KV_CACHE_DTYPE) rests on this table beside `kiln bench --kv-cache-dtype X`.

Usage: python scripts/kv_dtype_bench.py
"""

from __future__ import annotations

import torch

from kiln.kernels.attention import NativeDecode, best_time_us
from kiln.kernels.native.build import runnable_tiers
from kiln.model.kv_format import STORAGE, pack_rows

BLOCK = 16
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
CASES = [(1, 1024), (1, 4096), (32, 256), (32, 1024)]  # (sequences, context tokens per sequence)


def time_us(
    decode: NativeDecode, cache: torch.Tensor, q: torch.Tensor, table: torch.Tensor, lens: torch.Tensor
) -> float:
    return best_time_us(lambda: decode(q, cache, table, lens, 0, 0.0), 30)


def main() -> None:
    tier = runnable_tiers()[0].name
    decode = NativeDecode(tier)
    names = [n for n in STORAGE if n != "float32"]
    print(f"native-{tier}, {torch.get_num_threads()} threads; µs per layer (ratio to float32)\n")
    print("| sequences x context | float32 | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for sequences, context in CASES:
        width = -(-(context + 1) // BLOCK)
        values = torch.randn(2, KV_HEADS, width * sequences + 1, BLOCK, HEAD_DIM)
        table = torch.randperm(width * sequences).view(sequences, width)
        q = torch.randn(sequences, HEADS * HEAD_DIM)
        lens = torch.full((sequences,), context + 1)
        args = (q, table, lens)
        times = {name: time_us(decode, pack_rows(values, dtype), *args) for name, dtype in STORAGE.items()}
        cells = " | ".join(f"{times[n]:.0f} ({times['float32'] / times[n]:.2f}x)" for n in names)
        print(f"| {sequences} x {context} | {times['float32']:.0f} | {cells} |")


if __name__ == "__main__":
    main()
