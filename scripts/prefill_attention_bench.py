"""Prompts' attention and a verification's, kiln's native paged kernels beside the torch forms (one layer of
SmolLM2-135M's shape: 9 query heads, 3 KV heads, head_dim 64, 16-token blocks), then end to end on the default model.

1. `paged_prefill_attention` (kiln/kernels/native/paged_attention.cpp) against the grouped SDPA form
   (kiln.model.prefill_attention): fresh prompts, chunks over a long cached context, a few prompts over a prefix.
2. `paged_decode_attention` over a verification's 5 rows (one sequence's drafts, read as one block of queries)
   against one row and against the 5 rows called one at a time.
3. With --engine: the default model (eager, its packed weights) prefilling a 2,048-token prompt in one step and a
   3,000-token prompt in 64-token steps, the plan's prefill attention set to each form in turn (best of two).

Usage: python scripts/prefill_attention_bench.py [--engine]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from kiln import LLM, SamplingParams
from kiln.kernels.attention import NATIVE_PREFIX, TORCH, NativeDecode, NativePrefill, best_time_us
from kiln.kernels.native.build import runnable_tiers
from kiln.model.kv_format import pack_rows
from kiln.model.prefill_attention import grouped_prefill_attention

BLOCK = 16
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
# (new tokens, tokens in all, sequences, KV dtype)
PREFILL_CASES = [
    (512, 512, 1, torch.float32),
    (2048, 2048, 1, torch.float32),
    (16, 2048, 1, torch.float32),
    (17, 7000, 1, torch.float32),
    (64, 256, 8, torch.float32),
    (256, 4096, 1, torch.float32),
    (256, 4096, 1, torch.bfloat16),
    (256, 4096, 1, torch.int8),
]


def best_ms(call: Callable[[], object], reps: int = 5) -> float:
    return best_time_us(call, reps) / 1e3


def cache_of(blocks: int, dtype: torch.dtype) -> torch.Tensor:
    return pack_rows(torch.randn(2, KV_HEADS, blocks + 1, BLOCK, HEAD_DIM), dtype)


def prefill_table(tier: str) -> None:
    print("| new tokens x sequences | context | KV dtype | grouped SDPA ms | native ms | SDPA / native |")
    print("|---|---|---|---|---|---|")
    for new, total, sequences, dtype in PREFILL_CASES:
        width = -(-total // BLOCK)
        cache = cache_of(width * sequences, dtype)
        table = torch.randperm(width * sequences).view(sequences, width)
        q = torch.randn(new * sequences, HEADS * HEAD_DIM)
        args = (q, cache, table, torch.full((sequences,), total), torch.arange(sequences + 1) * new)
        grouped = best_ms(lambda: grouped_prefill_attention(*args, window=0, softcap=0.0))  # noqa: B023
        native = best_ms(lambda: NativePrefill(tier)(*args, window=0, softcap=0.0))  # noqa: B023
        kv = str(dtype).removeprefix("torch.")
        print(
            f"| {new} x {sequences} | {total - new} | {kv} | {grouped:.2f} | {native:.2f} | {grouped / native:.2f}x |"
        )


def verification_table(tier: str) -> None:
    decode = NativeDecode(tier)
    print("\n| context | KV dtype | 1 row us | 5 verification rows us | / 1 row | the 5 rows one at a time us |")
    print("|---|---|---|---|---|---|")
    for context in (512, 2048, 8000):
        for dtype in (torch.float32, torch.bfloat16):
            width = -(-(context + 5) // BLOCK)
            cache = cache_of(width, dtype)
            table = torch.randperm(width).view(1, width)
            one_q, five_q = torch.randn(1, HEADS * HEAD_DIM), torch.randn(5, HEADS * HEAD_DIM)
            lens = torch.arange(context + 1, context + 6)
            five_tables = table.expand(5, width).contiguous()
            one = best_ms(lambda: decode(one_q, cache, table, lens[:1], 0, 0.0), 20) * 1e3  # noqa: B023
            five = best_ms(lambda: decode(five_q, cache, five_tables, lens, 0, 0.0), 20) * 1e3  # noqa: B023
            apart = sum(best_ms(lambda: decode(one_q, cache, table, lens[i : i + 1], 0, 0.0), 20) for i in range(5))  # noqa: B023
            kv = str(dtype).removeprefix("torch.")
            print(f"| {context} | {kv} | {one:.0f} | {five:.0f} | {five / one:.2f}x | {apart * 1e3:.0f} |")


def engine_table(tier: str) -> None:
    native = NATIVE_PREFIX + tier
    params = SamplingParams(max_tokens=1, temperature=0)
    generator = torch.Generator().manual_seed(1)
    print()
    for tokens, step_tokens in [(2048, 2048), (3000, 64)]:
        llm = LLM("default", graph_mode="eager", max_num_batched_tokens=step_tokens, max_model_len=4096)
        plan = llm.engine.runner.executor.plan
        prompt = [int(t) for t in torch.randint(100, 20000, (tokens,), generator=generator)]
        seconds: dict[str, float] = {}
        for i, name in enumerate([TORCH, native] * 2):
            plan.prefill_attention = name
            start = time.perf_counter()
            llm.generate([[100 + i, *prompt[1:]]], params)  # a first token of its own: no prefix-cache hit
            seconds[name] = min(seconds.get(name, float("inf")), time.perf_counter() - start)
        ratio = seconds[TORCH] / seconds[native]
        forms = ", ".join(f"{name} {s:.2f} s ({tokens / s:.0f} tok/s)" for name, s in seconds.items())
        print(f"{tokens}-token prompt in {step_tokens}-token steps: {forms}; {ratio:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", action="store_true", help="also the default model end to end")
    args = parser.parse_args()
    tier = runnable_tiers()[0].name
    print(f"{torch.get_num_threads()} threads, native tier {tier}\n")
    prefill_table(tier)
    verification_table(tier)
    if args.engine:
        engine_table(tier)


if __name__ == "__main__":
    main()
