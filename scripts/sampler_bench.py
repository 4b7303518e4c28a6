"""The batched sampler against the row-by-row one it replaced (tests/engine/rowwise_sampler.py), on the default
model's vocabulary (49,152), at batch 1 and 32: every row greedy, and mixed settings (each row its own
temperature, top-k, top-p, min-p, penalties; at batch 1 one row with temperature and top-p), side by side in one
run (docs/benchmarks.md).

    .venv/bin/python scripts/sampler_bench.py [--vocab 49152] [--steps 40]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kiln.engine.sampling.sampler import Sampler, SamplingRow
from kiln.engine.sampling.sampling_params import SamplingParams
from tests.engine.rowwise_sampler import RowwiseSampler

MIXED = [
    {"temperature": 0.0},
    {"temperature": 0.8},
    {"temperature": 0.7, "top_p": 0.9},
    {"temperature": 1.0, "top_k": 40},
    {"temperature": 0.9, "min_p": 0.05, "repetition_penalty": 1.1},
    {"temperature": 1.1, "top_k": 50, "top_p": 0.95, "presence_penalty": 0.3, "frequency_penalty": 0.2},
]


def rows_for(batch: int, mixed: bool, vocab: int) -> list[SamplingRow]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(batch):
        setting = MIXED[(i + 2 * (batch == 1)) % len(MIXED)] if mixed else {"temperature": 0.0}  # batch 1: top-p
        prompt = torch.randint(vocab, (200,), generator=gen).tolist()
        output = torch.randint(vocab, (50,), generator=gen).tolist()
        params = SamplingParams(max_tokens=64, **setting)
        rows.append(SamplingRow(params, prompt, output, torch.Generator().manual_seed(i), []))
    return rows


def per_step_us(sampler: object, logits: torch.Tensor, rows: list[SamplingRow], steps: int) -> float:
    sampler(logits, rows)  # type: ignore[operator]
    start = time.perf_counter()
    for _ in range(steps):
        sampler(logits, rows)  # type: ignore[operator]
    return (time.perf_counter() - start) / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, vocab {args.vocab}")
    for batch, mixed in ((1, False), (1, True), (32, False), (32, True)):
        rows = rows_for(batch, mixed, args.vocab)
        logits = torch.randn(batch, args.vocab, generator=torch.Generator().manual_seed(1)) * 4
        old = per_step_us(RowwiseSampler(), logits, rows, args.steps)
        new = per_step_us(Sampler(), logits, rows, args.steps)
        what = ("top-p" if batch == 1 else "mixed settings") if mixed else "greedy"
        print(f"batch {batch:2d} {what:14s}: row by row {old:9.0f} us, batched {new:9.0f} us ({old / new:.2f}x)")


if __name__ == "__main__":
    main()
