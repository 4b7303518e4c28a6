"""Structured outputs with speculative decoding: JSON-schema outputs (an array of objects, so keys repeat) on the
default model, greedy, batch 1, with n-gram speculation off and on in turns (best of --repeats); the tokens must be
the same. Results go to docs/benchmarks.md.

    .venv/bin/python scripts/structured_spec_bench.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import time

from kiln import LLM, SamplingParams, StructuredOutput

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 16},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
SCHEMA = {
    "type": "object",
    "properties": {"people": {"type": "array", "items": PERSON, "minItems": 8, "maxItems": 8}},
    "required": ["people"],
    "additionalProperties": False,
}
KINDS = ("famous", "fictional", "young", "old")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ask = "List eight {} people with their age and city as JSON."
    asks = [[{"role": "user", "content": ask.format(kind)}] for kind in KINDS]
    params = SamplingParams(max_tokens=256, temperature=0, structured_output=StructuredOutput.json(SCHEMA))
    engines = {"off": LLM("default"), "ngram": LLM("default", speculative_method="ngram")}
    for llm in engines.values():
        llm.chat(asks[0], params)  # warm-up
    best = dict.fromkeys(engines, float("inf"))
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(args.repeats):
        for side, llm in engines.items():
            start = time.perf_counter()
            outs = [llm.chat(ask, params)[0] for ask in asks]
            best[side] = min(best[side], time.perf_counter() - start)
            tokens[side] = [out.token_ids for out in outs]
            for out in outs:
                json.loads(out.text)  # the constraint held
    total = sum(len(t) for t in tokens["off"])
    stats = engines["ngram"].engine.scheduler.speculator.stats.as_dict()
    print(
        f"batch 1, {total} tokens over {len(asks)} requests: off {total / best['off']:.1f} tok/s, ngram "
        f"{total / best['ngram']:.1f} tok/s ({best['off'] / best['ngram']:.2f}x); same tokens: "
        f"{tokens['off'] == tokens['ngram']}; {stats}"
    )


if __name__ == "__main__":
    main()
