"""Profile decode steps of the default model (eager or piecewise) at a given batch size and context length.

Usage: .venv/bin/python scripts/profile_decode.py [--batch 1] [--context 128] [--graph-mode eager] [--steps 20]
  [--quantization none]
Prints ms per step and the top operators by self CPU time (torch.profiler).
"""

from __future__ import annotations

import argparse
import time

from torch.profiler import profile

from kiln import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--graph-mode", default="eager", help="eager | piecewise | full | full_and_piecewise")
    ap.add_argument("--quantization", default="none", help="none | packed | int8 | int4")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto | float32 | bfloat16 | float16 | int8 | fp8_e4m3")
    ap.add_argument("--prefill", action="store_true", help="also print the prefill's top operators")
    args = ap.parse_args()
    llm = LLM(graph_mode=args.graph_mode, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    engine = llm.engine
    params = SamplingParams(max_tokens=args.steps * 3 + 10, temperature=0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"p{i}", [100 + i] * args.context, params)
    started = time.perf_counter()
    with profile() as prefill_prof:
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
            engine.step()
    print(f"prefill of {args.batch} x {args.context}: {time.perf_counter() - started:.2f} s (profiled)")
    if args.prefill:
        print(prefill_prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    for _ in range(3):
        engine.step()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step_ms = (time.perf_counter() - start) / args.steps * 1000
    print(f"batch={args.batch} context~{args.context}: {step_ms:.1f} ms/step, {args.batch * 1000 / step_ms:.1f} tok/s")
    with profile() as prof:
        for _ in range(args.steps):
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
