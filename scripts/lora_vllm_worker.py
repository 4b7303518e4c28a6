"""vLLM's side of scripts/lora_bench.py: run by the Python of vLLM's own environment (scripts/install_vllm.sh),
importing nothing of kiln, with a JSON request file and a JSON result path as its arguments. vLLM's `LLM(...)`
starts worker processes, so it runs under `if __name__ == "__main__"`.

The request: {"model_dir", "dtype", "adapters": [PEFT directories], "rank", "len", "prompts": [token ids, ...]}.
The same four timings as kiln's side, each pass from an empty prefix cache: all prompts at once on the base model,
then spread over the adapters (`--enable-lora`, one `LoRARequest` per adapter, round robin), then one prompt alone
without and with an adapter. Greedy, `ignore_eos`: every request makes `len` tokens. The result: {"version",
"<timing> tok/s": output tokens per second, ...}.
"""

from __future__ import annotations

import json
import sys
import time


def main(request_path: str, result_path: str) -> None:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    with open(request_path) as f:
        request = json.load(f)
    prompts = [{"prompt_token_ids": p} for p in request["prompts"]]
    llm = LLM(
        model=request["model_dir"],
        dtype=request["dtype"],
        enable_lora=True,
        max_loras=len(request["adapters"]),
        max_lora_rank=request["rank"],
        max_num_seqs=len(prompts),
        max_model_len=2 * request["len"] + 16,
        seed=0,
    )
    params = SamplingParams(max_tokens=request["len"], temperature=0.0, ignore_eos=True)
    loras = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(request["adapters"])]
    spread = [loras[i % len(loras)] for i in range(len(prompts))]

    def tok_s(batch: list[dict], lora: list | None) -> float:
        llm.reset_prefix_cache()  # as kiln's side: no pass finds another's prompts cached
        start = time.perf_counter()
        outs = llm.generate(batch, params, lora_request=lora, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)

    tok_s(prompts[:2], None)  # warm-up: the base path, then every adapter loaded once
    tok_s(prompts[: len(loras)], spread[: len(loras)])
    n = len(prompts)
    result = {
        "version": vllm.__version__,
        f"base {n} req tok/s": tok_s(prompts, None),
        f"lora {n} req tok/s": tok_s(prompts, spread),
        "base bs1 tok/s": tok_s(prompts[:1], None),
        "lora bs1 tok/s": tok_s(prompts[:1], spread[:1]),
    }
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
