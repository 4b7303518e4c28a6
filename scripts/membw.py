"""Measure this machine's memory read bandwidth the way batch-1 decode reads weights (fp32 streaming).

Usage: .venv/bin/python scripts/membw.py  — prints GB/s for a 1 GiB streaming sum and the fp32 roofline
for the default model (538 MB of weights per decode step).
"""

from __future__ import annotations

import time

import torch


def read_bandwidth_gbs(num_bytes: int = 1 << 30, repeats: int = 7) -> float:
    data = torch.rand(num_bytes // 4)  # rand touches every page, so reads really come from DRAM
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - start)
    return num_bytes / sorted(times)[len(times) // 2] / 1e9


if __name__ == "__main__":
    gbs = read_bandwidth_gbs()
    weights = 538e6
    roofline = gbs * 1e9 / weights
    print(f"threads={torch.get_num_threads()} read bandwidth {gbs:.1f} GB/s -> fp32 roofline {roofline:.1f} tok/s")
