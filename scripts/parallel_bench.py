"""Multi-device layouts side by side on this machine (one process vs tensor and pipeline parallel over gloo): decode
throughput and what each step moves between ranks. On a 2-core CPU the ranks share the cores, so this shows the cost
of communication and the pipeline's overlap, not a multi-device speed-up.

Usage: python scripts/parallel_bench.py [--batch 8] [--output-len 32] [--graph-mode M] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from kiln import LLM, SamplingParams
from kiln.distributed.ops import COMM

ONE_STEP = {"pipeline_parallel_size": 2, "pipeline_steps_in_flight": 1}
LAYOUTS = {
    "one process": {},
    "TP=2": {"tensor_parallel_size": 2},
    "PP=2, one step at a time": {**ONE_STEP, "pipeline_micro_batches": 1},
    "PP=2, 2 micro-batches": {**ONE_STEP, "pipeline_micro_batches": 2},
    "PP=2, 2 steps in flight": {"pipeline_parallel_size": 2},  # the default
}


def measure(options: dict, batch: int, output_len: int, graph_mode: str | None) -> dict:
    prompts = [f"Write a short story about the number {i}." for i in range(batch)]
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    graph = {"graph_mode": graph_mode} if graph_mode else {}
    with LLM("default", dtype="float32", quantization="none", seed=0, **graph, **options) as llm:
        llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0))  # warm-up
        steps_before = llm.engine.num_steps
        COMM.reset()
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        steps = llm.engine.num_steps - steps_before
    tokens = sum(len(o.token_ids) for o in outs)
    comm = {kind: v["bytes"] / steps for kind, v in COMM.as_dict().items()}
    return {
        "tok_s": tokens / elapsed,
        "steps": steps,
        "bytes_per_step_rank0": comm,
        "tokens": [o.token_ids for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--graph-mode", help="a graph mode (default: eager)")
    ap.add_argument("--json")
    args = ap.parse_args()
    results = {name: measure(opts, args.batch, args.output_len, args.graph_mode) for name, opts in LAYOUTS.items()}
    base = results["one process"]
    mode = args.graph_mode or "eager"
    print(f"{platform.machine()}, torch {torch.__version__}, batch {args.batch}, {mode}")
    for name, r in results.items():
        same = r["tokens"] == base["tokens"]
        moved = ", ".join(f"{k} {v / 1e3:.1f} kB" for k, v in r["bytes_per_step_rank0"].items()) or "-"
        ratio = r["tok_s"] / base["tok_s"]
        print(f"{name:26s} {r['tok_s']:7.1f} tok/s ({ratio:.2f}x)  same tokens: {same}  rank 0 per step: {moved}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: {kk: vv for kk, vv in v.items() if kk != "tokens"} for k, v in results.items()}, f, indent=1)


if __name__ == "__main__":
    main()
