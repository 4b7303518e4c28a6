"""What scoring or embedding a prompt costs: prefills of the same prompts plain, with prompt logprobs and as
embeddings (`LLM.embed`), side by side.

  .venv/bin/python scripts/prompt_logprobs_bench.py [--prompts 4] [--prompt-len 1024] [--repeats 3]

Each pass prefills `prompts` random prompts of `prompt_len` tokens (one output token each, prefix caching off so
every pass computes every prompt); the passes alternate (plain, scored, embedded, plain, ...) and the median of each is
reported with its ratio to the plain prefill (issue 53's bars: scoring <= 1.1x, embeddings at >= 0.9x the plain
prefill's tokens per second, i.e. <= 1.11x its time), by wall time and by the process's CPU time (steadier on a
shared machine, where other guests' work stretches wall time). Scoring's extra work is the head over every prompt
row (the vocabulary's logits, its logsumexp, the target's rank), which a plain prefill runs for the last row only;
an embedding pools the final hidden states and runs no head.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from kiln import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--graph-mode", default="full_and_piecewise")
    args = ap.parse_args()
    llm = LLM(graph_mode=args.graph_mode, enable_prefix_caching=False, max_model_len=args.prompt_len + 16)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    plain = SamplingParams(max_tokens=1, temperature=0)
    scored = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    llm.generate(prompts[:1], plain)  # warm-up: captures, kernel choices
    llm.generate(prompts[:1], scored)
    llm.embed(prompts[:1])
    names = ("plain", "prompt_logprobs=1", "embed")
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}  # this process's CPU seconds (all its threads)
    for _ in range(args.repeats):
        for name in names:
            start, start_cpu = time.perf_counter(), time.process_time()
            if name == "embed":
                embedded = llm.embed(prompts)
                assert all(len(e.outputs.embedding) == llm.engine.model_config.hidden_size for e in embedded)
            else:
                outs = llm.generate(prompts, plain if name == "plain" else scored)
                assert all(o.finish_reason == "length" for o in outs)
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    tokens = args.prompts * args.prompt_len
    medians = {name: statistics.median(t) for name, t in wall.items()}
    cpu_medians = {name: statistics.median(t) for name, t in cpu.items()}
    for name, seconds in medians.items():
        print(
            f"{name:>18}: {seconds:.3f} s for {tokens} prompt tokens ({tokens / seconds:,.0f} tok/s), "
            f"{cpu_medians[name]:.3f} CPU s"
        )
    for name in ("prompt_logprobs=1", "embed"):
        # CPU time is the steadier of the two on a shared machine: time stolen by other guests is not counted
        print(
            f"{name} / plain: {medians[name] / medians['plain']:.3f}x time, "
            f"{cpu_medians[name] / cpu_medians['plain']:.3f}x CPU time"
        )


if __name__ == "__main__":
    main()
