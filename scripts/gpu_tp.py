"""Tensor and pipeline parallelism on CUDA (NCCL) for scripts/gpu_check.sh: with 2+ GPUs, TP=2 and PP=2 give one GPU's
greedy tokens in eager and full_and_piecewise mode, and each mode's decode speed is printed beside one GPU's.
With fewer GPUs it says so and exits 0 (nothing to check).

Usage: python scripts/gpu_tp.py MODEL
"""

from __future__ import annotations

import sys
import time

import torch

from kiln import LLM, SamplingParams


def run(model: str, **options: object) -> tuple[list[list[int]], float]:
    prompts = ["The capital of France is", "def fib(n):", "Three primary colors are", "Once upon a time"]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    with LLM(model, device="cuda", dtype="float32", quantization="none", seed=0, **options) as llm:
        llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0))  # warm-up
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        tok_s = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)
    return [o.token_ids for o in outs], tok_s


def main() -> int:
    if torch.cuda.device_count() < 2:
        print(f"tensor/pipeline parallel on CUDA: skipped, torch sees {torch.cuda.device_count()} GPU(s)")
        return 0
    model = sys.argv[1]
    failed = 0
    for mode in ("eager", "full_and_piecewise"):
        graph = {} if mode == "eager" else {"graph_mode": mode}
        ref, ref_speed = run(model, **graph)
        for split in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}):
            tokens, speed = run(model, **graph, **split)
            same = tokens == ref
            failed += not same
            print(f"{mode} {split}: tokens equal one GPU's: {same}; {speed:.1f} tok/s vs {ref_speed:.1f} on one GPU")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
