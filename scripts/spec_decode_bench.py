"""Speculative decoding's gain: the default model, n-gram speculation (and, with --draft-model, a draft model) on
and off side by side in one run, at batch 1 and 8 (each side run --repeats times in turns, the best kept), on an
input-grounded workload (chat prompts asking to repeat, or lightly edit, a passage they contain:
scripts/spec_passages.txt) and on free generation (short stories); greedy, exactly --output-len tokens each. With
llama-cpp-python installed (`make llamacpp`), llama.cpp's prompt-lookup decoding (LlamaPromptLookupDecoding) beside
it at batch 1 (the binding speculates in its one-sequence `generate` only). Results go to docs/benchmarks.md.

    .venv/bin/python scripts/spec_decode_bench.py [--output-len 256] [--num-speculative-tokens 4] [--json out.json]
        [--draft-model DIR]   # a draft model with the default model's vocabulary, or "default" itself
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kiln import LLM
from kiln.bench.kiln_runner import run_kiln, warm_up_kiln
from kiln.bench.metrics import RunResult
from kiln.model.tokenizer import KilnTokenizer

ROOT = Path(__file__).resolve().parent.parent
TOPICS = ["a lighthouse keeper", "a lost robot", "a city under the sea", "a dragon who bakes bread",
          "the last train of the night", "a garden on Mars", "a clockmaker's apprentice", "a storm at sea"]  # fmt: skip
EDITS = ["Repeat the following text exactly, word for word.", "Rewrite the following text, writing 'the engine' "
         "wherever it says 'kiln'; change nothing else."]  # fmt: skip


def passages(count: int) -> list[str]:
    """Two consecutive paragraphs of scripts/spec_passages.txt each (plain prose, about 230 tokens together, so
    repeating one fills most of 256 output tokens)."""
    found = [" ".join(p.split()) for p in (ROOT / "scripts" / "spec_passages.txt").read_text().split("\n\n")]
    found = [p for p in found if p]
    return [f"{found[i % len(found)]}\n\n{found[(i + 1) % len(found)]}" for i in range(count)]


def workloads(tokenizer: KilnTokenizer, count: int) -> dict[str, list[list[int]]]:
    chat = tokenizer.encode_chat
    grounded = [chat([{"role": "user", "content": f"{EDITS[i % 2]}\n\n{p}"}]) for i, p in enumerate(passages(count))]
    free = [chat([{"role": "user", "content": f"Write a short story about {t}."}]) for t in TOPICS[:count]]
    return {"input-grounded": grounded, "free generation": free}


def llamacpp_lookup(model_path: str, prompts: list[list[int]], output_len: int, k: int) -> dict[str, float] | None:
    """llama.cpp's batch-1 output tok/s over `prompts` without and with prompt-lookup decoding (None: not installed)."""
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        return None
    rates = {}
    for name, draft in (("plain", None), ("lookup", LlamaPromptLookupDecoding(num_pred_tokens=k))):
        llm = Llama(model_path, n_ctx=4096, n_threads=2, n_batch=512, draft_model=draft, verbose=False, seed=0)
        total, wall = 0, 0.0
        for prompt in prompts:
            llm.reset()  # NOTE: generate(reset=True) keeps a matching prefix; past 4 prompts the context overflowed
            start, n = time.perf_counter(), 0
            for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
                n += 1
                if n == output_len:
                    break
            wall, total = wall + time.perf_counter() - start, total + n
        rates[name] = total / wall
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each side, in turns; the best is reported")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--draft-model", default=None, help="also the draft method with this draft model (same vocabulary) as a side"
    )
    args = parser.parse_args()
    k = args.num_speculative_tokens
    engines = {"off": LLM("default"), "ngram": LLM("default", speculative_method="ngram", num_speculative_tokens=k)}
    if args.draft_model:
        spec = dict(speculative_method="draft", speculative_model=args.draft_model, num_speculative_tokens=k)
        engines["draft"] = LLM("default", **spec)
    loads = workloads(engines["off"].tokenizer, 8)
    for llm in engines.values():
        warm_up_kiln(llm, loads["free generation"][0])
    report: dict[str, dict] = {}
    for load, prompts in loads.items():
        for bs in (int(b) for b in args.batch_sizes.split(",")):
            batch = prompts[: 4 if bs == 1 else 8]
            best: dict[str, RunResult] = {}
            for _ in range(args.repeats):  # in turns, so machine drift hits both sides alike; the best run of each
                for side, llm in engines.items():
                    run = run_kiln(llm, side, batch, args.output_len, bs)
                    if side not in best or run.wall_s < best[side].wall_s:
                        best[side] = run
            off = best["off"]
            row = {"off_output_tok_s": off.output_tok_s, "off_decode_tok_s_per_seq": off.decode_tok_s_per_seq}
            for side, on in best.items():
                if side == "off":
                    continue
                row |= {
                    f"{side}_output_tok_s": on.output_tok_s,
                    f"{side}_speedup": on.output_tok_s / off.output_tok_s,
                    f"{side}_decode_tok_s_per_seq": on.decode_tok_s_per_seq,
                    f"{side}_decode_speedup": on.decode_tok_s_per_seq / off.decode_tok_s_per_seq,
                    f"{side}_acceptance_length": on.acceptance_length,
                }
                print(f"{load} bs {bs} {side}: output {off.output_tok_s:.1f} -> {on.output_tok_s:.1f} tok/s "
                      f"({row[f'{side}_speedup']:.2f}x), decode/seq {row[f'{side}_decode_speedup']:.2f}x, "
                      f"acceptance length {on.acceptance_length:.2f}", flush=True)  # fmt: skip
            report[f"{load} bs{bs}"] = row
        lookup = llamacpp_lookup(engines["off"].engine.checkpoint_path, prompts[:4], args.output_len, k)
        if lookup is not None:
            report[f"{load} llama.cpp bs1"] = lookup | {"speedup": lookup["lookup"] / lookup["plain"]}
            print(f"{load} llama.cpp bs 1: {lookup['plain']:.1f} -> {lookup['lookup']:.1f} tok/s with prompt lookup "
                  f"({lookup['lookup'] / lookup['plain']:.2f}x)", flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
