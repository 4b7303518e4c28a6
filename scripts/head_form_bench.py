"""The W4A16 checkpoint's unquantized head, float32 as loaded against the second forms the kernel plan bound to it
(kiln.kernels.head_forms: a bf16 copy, an int8 Q8_0 copy, by row class), beside the Q4_1 GGUF default model: three
engines' worth of work in ONE process, interleaved round by round (a shared machine slows all three alike), medians
reported: batch 1 (a 16-token prompt) and 32 requests (128-token prompts), output tokens per second. The W4A16 engine
runs both heads: its logits head is switched between the bound forms and the float32 head (with the column-major
one-row copy the plan makes without a form).

    .venv/bin/python scripts/compress_w4a16.py --out /tmp/ckx/smol-w4a16
    .venv/bin/python scripts/head_form_bench.py --model /tmp/ckx/smol-w4a16 [--rounds 5] [--num-threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kiln import LLM, SamplingParams
from kiln.kernels.layout import COLUMN_MAJOR, with_layout


def output_tok_s(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the W4A16 checkpoint (scripts/compress_w4a16.py)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    options = {"num_threads": args.num_threads, "max_num_seqs": 32, "enable_prefix_caching": False}
    gguf, w4a16 = LLM("default", **options), LLM(args.model, **options)
    head = w4a16.engine.executor.logits_head
    forms, weight = head.forms, w4a16.engine.model.lm_head.weight
    if forms is None or forms.kernel(1) is None:
        raise SystemExit("the W4A16 engine bound no head form at one row here: nothing to compare")
    float_head_t = with_layout(weight.detach(), COLUMN_MAJOR).t()  # what the plan keeps without the form
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (128,), generator=generator).tolist() for _ in range(32)]
    print(f"W4A16 logits head: {forms.summary()}")
    systems = {"Q4_1 GGUF": (gguf, None), "W4A16 float32 head": (w4a16, False), "W4A16 head forms": (w4a16, True)}
    results: dict[str, dict[str, list[float]]] = {name: {"bs1": [], "bs32": []} for name in systems}
    for _ in range(args.rounds):
        for name, (llm, bound) in systems.items():
            if bound is not None:
                head.forms, head.head_t = (forms, None) if bound else (None, float_head_t)
            results[name]["bs1"].append(output_tok_s(llm, [prompts[0][:16]], args.output_len))  # mostly decode
            results[name]["bs32"].append(output_tok_s(llm, prompts, args.output_len))
            bs1, bs32 = results[name]["bs1"][-1], results[name]["bs32"][-1]
            print(f"{name}: batch 1 {bs1:.1f}, 32 requests {bs32:.1f} tok/s", flush=True)
    base = {k: statistics.median(v) for k, v in results["Q4_1 GGUF"].items()}
    for name, runs in results.items():
        bs1, bs32 = statistics.median(runs["bs1"]), statistics.median(runs["bs32"])
        print(
            f"{name:20s} batch 1: {bs1:7.1f} tok/s ({bs1 / base['bs1']:.2f}x)   32 requests: {bs32:7.1f} out tok/s "
            f"({bs32 / base['bs32']:.2f}x)   runs bs1 {[round(r, 1) for r in runs['bs1']]} "
            f"bs32 {[round(r, 1) for r in runs['bs32']]}"
        )


if __name__ == "__main__":
    main()
