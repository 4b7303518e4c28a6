"""The vLLM anchor's worker: run by the Python of vLLM's own virtual environment (scripts/install_vllm.sh), never
imported by kiln (kiln is not installed there, and vLLM is not installed in kiln's), with a JSON request file and
a JSON result path as its arguments. vLLM's `LLM(...)` starts worker processes, so it runs under
`if __name__ == "__main__"`.

The request: {"model_dir", "dtype", "batches": {batch size: [token ids, ...]}, "output_len", "max_model_len"}.
Per batch size, as kiln's closed loop (kiln.bench.kiln_runner), each pass from an empty prefix cache: a
prefill-only pass (one output token each) at the same concurrency, then the timed pass, at most `batch size`
requests in flight, each added as soon as one finishes; greedy, `ignore_eos`, so every request makes `output_len`
tokens. The result: {"version", "runs": [{"batch_size", "wall_s", "prefill_s", "done": [[arrival, first token,
finished, token ids], ...]}]}, monotonic clock times.
"""

from __future__ import annotations

import json
import sys
import time


def closed_loop(llm, prompts: list[list[int]], output_len: int, batch_size: int, tag: str):
    from vllm import SamplingParams

    # NOTE: each pass starts from an empty prefix cache, as kiln's does: vLLM caches prefixes by default, and the
    # timed pass would otherwise find every prompt of the prefill-only pass before it already computed
    llm.reset_prefix_cache()
    engine = llm.llm_engine

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    arrival: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, list] = {}
    added = 0
    start = time.monotonic()
    while len(done) < len(prompts):
        while added < len(prompts) and added - len(done) < batch_size:
            request_id = f"{tag}-{added}"
            arrival[request_id] = time.monotonic()
            engine.add_request(request_id, {"prompt_token_ids": prompts[added]}, params)
            added += 1
        for out in engine.step():
            now = time.monotonic()
            tokens = list(out.outputs[0].token_ids)
            if tokens and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                done[out.request_id] = [arrival[out.request_id], first.get(out.request_id, now), now, tokens]
    wall_s = time.monotonic() - start
    return wall_s, [done[f"{tag}-{i}"] for i in range(len(prompts))]


def main(request_path: str, result_path: str) -> None:
    import vllm
    from vllm import LLM

    with open(request_path) as f:
        request = json.load(f)
    batches = {int(bs): prompts for bs, prompts in request["batches"].items()}
    llm = LLM(
        model=request["model_dir"],
        dtype=request["dtype"],
        max_model_len=request["max_model_len"],
        max_num_seqs=max(batches),
        seed=0,
    )
    first_prompts = next(iter(batches.values()))
    closed_loop(llm=llm, prompts=first_prompts[:1], output_len=2, batch_size=1, tag="warm-up")
    runs = []
    for bs, prompts in batches.items():
        prefill_s, _ = closed_loop(llm=llm, prompts=prompts, output_len=1, batch_size=bs, tag=f"prefill-{bs}")
        wall_s, done = closed_loop(
            llm=llm, prompts=prompts, output_len=request["output_len"], batch_size=bs, tag=f"run-{bs}"
        )
        runs.append({"batch_size": bs, "wall_s": wall_s, "prefill_s": prefill_s, "done": done})
        print(f"vllm bs={bs}: {len(prompts) * request['output_len'] / wall_s:.1f} output tok/s", flush=True)
    with open(result_path, "w") as f:
        json.dump({"version": vllm.__version__, "runs": runs}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
