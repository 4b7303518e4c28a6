"""Measure this machine's memory read bandwidth the way batch-1 decode reads weights (fp32 streaming).

Usage: .venv/bin/python scripts/membw.py  — prints GB/s for a 1 GiB streaming sum and the fp32 roofline
for the default model (538 MB of weights per decode step). `kiln bench` measures the same once per run.
"""

from __future__ import annotations

import torch

from kiln.bench.roofline import read_bandwidth_gbs

if __name__ == "__main__":
    gbs = read_bandwidth_gbs()
    weights = 538e6
    roofline = gbs * 1e9 / weights
    print(f"threads={torch.get_num_threads()} read bandwidth {gbs:.1f} GB/s -> fp32 roofline {roofline:.1f} tok/s")
