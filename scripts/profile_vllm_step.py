"""Where vLLM's CPU decode step goes: the anchor's side of the op-by-op table in docs/benchmarks.md.

Run with vLLM's own Python (`make vllm`), on the bf16 HF directory `kiln bench --compare vllm` makes in the kiln
cache (the default model dequantized by transformers):

  VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-1 \
    .venv-vllm/bin/python scripts/profile_vllm_step.py --model-dir <bf16 dir> --batch 32 --context 128

The engine runs in this process (V1 multiprocessing off), so torch.profiler sees the model's ops. It prefills
`batch` prompts of `context` tokens, takes a few warm-up decode steps, times `steps` decode steps, then profiles as
many and prints the top operators by self CPU time. kiln's side: scripts/profile_decode.py.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16 (kiln bench's anchor) | float32")
    args = ap.parse_args()
    from torch.profiler import profile
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model_dir, dtype=args.dtype, max_model_len=1024, max_num_seqs=args.batch, seed=0)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=args.steps * 3 + 10, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"p{i}", {"prompt_token_ids": [100 + i] * args.context}, params)
    prefill, started = time.perf_counter(), set()
    while len(started) < args.batch:
        started |= {o.request_id for o in engine.step() if o.outputs[0].token_ids}
    print(f"prefill of {args.batch} x {args.context}: {time.perf_counter() - prefill:.2f} s")
    for _ in range(3):
        engine.step()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step_ms = (time.perf_counter() - start) / args.steps * 1000
    rate = args.batch * 1000 / step_ms
    print(f"vLLM batch={args.batch} context~{args.context}: {step_ms:.1f} ms/step, {rate:.1f} tok/s")
    with profile() as prof:
        for _ in range(args.steps):
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
