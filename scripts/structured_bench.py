"""Structured-output cost: decode time per token with a JSON-schema constraint against unconstrained decoding of
the same lengths, at batch 1 and 32, one engine, side by side in one run (docs/benchmarks.md).

The schema (an array of at least 200 short strings) cannot finish within --max-tokens, so every sequence
decodes exactly --max-tokens tokens in both runs (the unconstrained one ignores EOS).

    .venv/bin/python scripts/structured_bench.py [--graph-mode full_and_piecewise] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import time

from kiln import LLM, SamplingParams, StructuredOutput

SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 200}


def per_token_ms(llm: LLM, batch: int, runs: list[SamplingParams], repeats: int) -> list[float]:
    """The best ms per decode step of each of `runs`, timed in turns (so drift hits both alike)."""
    prompts = [f"List {i + 3} names of rivers as a JSON array:" for i in range(batch)]
    best = [float("inf")] * len(runs)
    for _ in range(repeats):
        for i, params in enumerate(runs):
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            elapsed = time.perf_counter() - start
            assert all(len(o.token_ids) == params.max_tokens for o in outs), [len(o.token_ids) for o in outs]
            best[i] = min(best[i], elapsed / params.max_tokens * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graph-mode", default=None, help="kiln's default when omitted")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    llm = LLM("default", seed=0, **({"graph_mode": args.graph_mode} if args.graph_mode else {}))
    free = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    held = SamplingParams(max_tokens=args.max_tokens, temperature=0, structured_output=StructuredOutput.json(SCHEMA))
    llm.generate(["warm up"], held)  # the grammar compiled once, the tokenizer's trie built
    rows = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        plain, constrained = per_token_ms(llm, batch, [free, held], args.repeats)
        rows.append({"batch": batch, "free_ms": plain, "json_schema_ms": constrained, "ratio": constrained / plain})
        print(f"batch {batch:3d}: {plain:7.2f} ms/step free, {constrained:7.2f} ms/step with the schema "
              f"({constrained / plain:.3f}x)")  # fmt: skip
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
