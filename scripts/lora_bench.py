"""What LoRA adapters cost (issue 54's performance bars), side by side in one run on the default model.

  .venv/bin/python scripts/lora_bench.py [--requests 32] [--len 128] [--adapters 4] [--rank 16] [--vllm]
      [--lora-dtype auto|float32|bfloat16] [--repeats 1] [--skip-server]

1. Offline, kiln's default graph mode: 32 requests of 128 prompt / 128 output tokens (greedy, EOS ignored) on an
   engine without LoRA, then on an engine with `--enable-lora --max-loras 4 --max-lora-rank 16`, the requests spread
   over 4 rank-16 adapters on all seven targets (q, k, v, o, gate, up, down); output tokens per second of each and
   their ratio (bar: >= 0.8x). Batch-1 decode with an adapter against the engine without LoRA (bar: >= 0.85x).
   `--repeats N` times each side N times, base and LoRA in turn, and reports the medians (a shared machine).
2. A running server (`kiln serve --enable-lora --allow-runtime-lora-updating`) streams one request while a rank-16
   adapter is loaded through POST /v1/load_lora_adapter: the load's latency (bar: <= 1 s) and the stream's largest
   gap between tokens against its median (bar: no pause longer than one step).
3. `--vllm`: vLLM's CPU build (.venv-vllm, `make vllm`) on the same adapters and requests, with its LoRA support
   (its bf16 HF copy of the default model, kiln.bench.vllm_runner.hf_dir_for), the same threads.

The adapters are random PEFT checkpoints written here for the base's HF architecture (peft, B scaled small so the
outputs stay finite); kiln reads them as any PEFT directory.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from kiln import LLM, SamplingParams
from kiln.bench.vllm_runner import hf_dir_for, vllm_python, worker_env
from kiln.lora import LoRARequest
from kiln.model.loader import resolve_model_path

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapters(folder: Path, count: int, rank: int) -> list[Path]:
    """`count` random rank-`rank` PEFT adapters over the default model's HF architecture, all seven targets."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    config = transformers.AutoConfig.from_pretrained(hf_dir_for(resolve_model_path("default")))
    paths = []
    for i in range(count):
        torch.manual_seed(i)
        base = transformers.AutoModelForCausalLM.from_config(config)
        lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
        model = get_peft_model(base, lora)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.mul_(0.01)
        path = folder / f"adapter{i}"
        model.save_pretrained(path)
        paths.append(path)
    return paths


def prompts_of(n: int, length: int, vocab: int) -> list[list[int]]:
    return [[(1009 * i + 7 * j) % (vocab - 200) + 100 for j in range(length)] for i in range(n)]


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams, loras: list[LoRARequest | None] | None) -> float:
    """Output tokens per second of one batch (all requests at once, the engine's continuous batching)."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras) if loras else llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / seconds


def offline(args: argparse.Namespace, adapters: list[Path]) -> dict[str, float]:
    params = SamplingParams(max_tokens=args.len, temperature=0.0, ignore_eos=True)
    base = LLM("default", max_num_seqs=args.requests)
    prompts = prompts_of(args.requests, args.len, base.engine.model_config.vocab_size)
    requests = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    spread = [requests[i % len(requests)] for i in range(args.requests)]
    timed(base, prompts[:2], params, None)  # warm-up: kernel choices, captures
    lora = LLM(
        "default",
        max_num_seqs=args.requests,
        enable_lora=True,
        max_loras=len(adapters),
        max_lora_rank=args.rank,
        lora_dtype=args.lora_dtype,
    )
    timed(lora, prompts[:4], params, spread[:4])
    runs: dict[str, list[float]] = {}
    for _ in range(args.repeats):  # base and LoRA in turn: the machine's other load falls on both alike
        runs.setdefault("base 32 req tok/s", []).append(timed(base, prompts, params, None))
        runs.setdefault("lora 32 req tok/s", []).append(timed(lora, prompts, params, spread))
        runs.setdefault("base bs1 tok/s", []).append(timed(base, prompts[:1], params, None))
        runs.setdefault("lora bs1 tok/s", []).append(timed(lora, prompts[:1], params, spread[:1]))
    results = {name: statistics.median(times) for name, times in runs.items()}
    results["32 req ratio"] = results["lora 32 req tok/s"] / results["base 32 req tok/s"]
    results["bs1 ratio"] = results["lora bs1 tok/s"] / results["base bs1 tok/s"]
    return results


def served(args: argparse.Namespace, adapters: list[Path]) -> dict[str, float]:
    port = 8123
    cmd = [sys.executable, "-m", "kiln.cli", "serve", "--port", str(port), "--enable-lora", "--max-loras", "4"]
    cmd += ["--max-lora-rank", str(args.rank), "--allow-runtime-lora-updating"]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        times: list[float] = []
        body = {"model": "default", "prompt": "Once upon a time", "max_tokens": 256, "ignore_eos": True}

        def stream() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=600) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        times.append(time.perf_counter())

        reader = threading.Thread(target=stream)
        reader.start()
        while len(times) < 64:
            time.sleep(0.01)
        start = time.perf_counter()
        answer = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(adapters[0])})
        load_s = time.perf_counter() - start
        assert answer.status_code == 200, answer.text
        reader.join()
        gaps = [b - a for a, b in itertools.pairwise(times)]
        return {"load s": load_s, "largest gap s": max(gaps), "median gap s": statistics.median(gaps)}
    finally:
        server.terminate()
        server.wait(timeout=60)


VLLM_WORKER = """
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
req = json.load(open(sys.argv[1]))
llm = LLM(model=req["model_dir"], dtype="bfloat16", enable_lora=True, max_loras=len(req["adapters"]),
          max_lora_rank=req["rank"], max_num_seqs=len(req["prompts"]), max_model_len=2 * req["len"] + 16)
params = SamplingParams(max_tokens=req["len"], temperature=0.0, ignore_eos=True)
loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(req["adapters"])]
prompts = [{"prompt_token_ids": p} for p in req["prompts"]]
spread = [loras[i % len(loras)] for i in range(len(prompts))]
def run(ps, lr):
    start = time.perf_counter()
    outs = llm.generate(ps, params, lora_request=lr, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
run(prompts[:4], spread[:4])
out = {"base 32 req tok/s": run(prompts, None), "lora 32 req tok/s": run(prompts, spread),
       "base bs1 tok/s": run(prompts[:1], None), "lora bs1 tok/s": run(prompts[:1], spread[:1])}
json.dump(out, open(sys.argv[2], "w"))
"""


def vllm(args: argparse.Namespace, adapters: list[Path]) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="kiln-vllm-lora-") as tmp:
        request, result, worker = Path(tmp) / "req.json", Path(tmp) / "out.json", Path(tmp) / "worker.py"
        worker.write_text(VLLM_WORKER)
        request.write_text(
            json.dumps(
                {
                    "model_dir": str(hf_dir_for(resolve_model_path("default"))),
                    "adapters": [str(p) for p in adapters],
                    "rank": args.rank,
                    "len": args.len,
                    "prompts": prompts_of(args.requests, args.len, 49152),
                }
            )
        )
        threads = args.threads or os.cpu_count() or 1
        proc = subprocess.run(
            [str(vllm_python()), str(worker), str(request), str(result)],
            env=worker_env(threads),
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            return {"refused": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "no output"}
        return json.loads(result.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--len", type=int, default=128)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--lora-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--vllm", action="store_true")
    ap.add_argument("--skip-server", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-lora-bench-") as tmp:
        adapters = write_adapters(Path(tmp), args.adapters, args.rank)
        report = {"kiln offline": offline(args, adapters)}
        if not args.skip_server:
            report["kiln server load"] = served(args, adapters)
        if args.vllm:
            report["vllm"] = vllm(args, adapters)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
