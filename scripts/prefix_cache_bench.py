"""Prefix caching's cost where nothing is shared: one engine runs the same random prompts with its prefix cache
on and with it switched off (the scheduler without `prefix`), in turns, so machine drift hits both alike; the
best wall time of each side and their ratio (docs/benchmarks.md). With --shared-prefix-len the prompts share a
prefix, and the ratio is caching's gain.

    .venv/bin/python scripts/prefix_cache_bench.py [--input-len 128] [--output-len 32] [--batch-sizes 1,32]
"""

from __future__ import annotations

import argparse
import json

from kiln import LLM
from kiln.bench.kiln_runner import run_kiln, warm_up_kiln
from kiln.bench.metrics import random_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graph-mode", default=None, help="kiln's default when omitted")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--shared-prefix-len", type=int, default=0)
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--num-requests", type=int, default=32, help="at batch sizes above 1; 4 at batch 1")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    llm = LLM("default", **({"graph_mode": args.graph_mode} if args.graph_mode else {}))
    scheduler = llm.engine.scheduler
    prefix_sharing = scheduler.prefix
    assert prefix_sharing is not None, "prefix caching is off for this model"
    vocab = llm.engine.model_config.vocab_size
    prompts = random_prompts(args.num_requests, args.input_len, vocab, seed=0)
    if args.shared_prefix_len:
        shared = random_prompts(1, args.shared_prefix_len, vocab, seed=1)[0]
        prompts = [shared + p for p in prompts]
    warm_up_kiln(llm, prompts[0])
    report = {}
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        batch = prompts[: 4 if bs == 1 else args.num_requests]
        best = {"on": float("inf"), "off": float("inf")}
        for _ in range(args.repeats):
            for side in best:
                scheduler.prefix = prefix_sharing
                llm.engine.reset_prefix_cache(quiet=True)  # the off side starts from a pool of plain free blocks
                scheduler.prefix = prefix_sharing if side == "on" else None
                run = run_kiln(llm, side, batch, args.output_len, bs)
                best[side] = min(best[side], run.wall_s)
        scheduler.prefix = prefix_sharing
        report[bs] = {"on_s": best["on"], "off_s": best["off"], "on_over_off_tok_s": best["off"] / best["on"]}
        print(f"bs {bs}: caching on {best['on']:.2f} s, off {best['off']:.2f} s: on/off throughput "
              f"{best['off'] / best['on']:.3f}x", flush=True)  # fmt: skip
    print(json.dumps(report))


if __name__ == "__main__":
    main()
