"""What LoRA adapters cost (issue 54's performance bars), side by side in one run on the default model.

  .venv/bin/python scripts/lora_bench.py [--requests 32] [--len 128] [--adapters 4] [--rank 16] [--vllm]
      [--lora-dtype auto|float32|bfloat16] [--repeats 1] [--skip-server]

1. Offline, kiln's default graph mode: 32 requests of 128 prompt / 128 output tokens (greedy, EOS ignored) on an
   engine without LoRA, then on an engine with `--enable-lora --max-loras 4 --max-lora-rank 16`, the requests spread
   over 4 rank-16 adapters on all seven targets (q, k, v, o, gate, up, down); output tokens per second of each and
   their ratio (bar: >= 0.8x). Batch-1 decode with an adapter against the engine without LoRA (bar: >= 0.85x): one
   request's decode tokens per second, its run to 8 tokens taken from its run to `--len` (the prefill cancels out).
   `--repeats N` times each side N times, base and LoRA in turn, and reports the medians (a shared machine).
2. A running server (`kiln serve --enable-lora --allow-runtime-lora-updating`) streams one request while a rank-16
   adapter is loaded through POST /v1/load_lora_adapter: the load's latency (bar: <= 1 s) and the stream's largest
   gap between tokens against its median and against the same stream's with no load beside it (bar: no pause
   longer than one step).
3. `--vllm`: vLLM's CPU build (.venv-vllm, `make vllm`, or $KILN_VLLM_PYTHON) runs the same four timings on the same
   adapters and prompts with its LoRA support (`enable_lora`, one `LoRARequest` per adapter: scripts/lora_vllm_worker.py
   in vLLM's own environment), on its bf16 HF copy of the default model (kiln.bench.vllm_runner.hf_dir_for), bound to
   as many CPUs as `--threads` (default: all this process may use). A vLLM that fails is reported as refused, with
   its last error line.

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
from kiln.bench.vllm_runner import DTYPE, check_vllm, hf_dir_for, vllm_python, worker_env
from kiln.lora import LoRARequest
from kiln.model.loader import resolve_model_path

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VOCAB = 49152  # the default model's: both engines get the same prompts


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
    """Output tokens per second of one batch (all requests at once, the engine's continuous batching), from an empty
    prefix cache (as vLLM's side: no pass finds another's prompts cached)."""
    llm.engine.reset_prefix_cache(quiet=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras) if loras else llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / seconds


def decode_rate(llm: LLM, prompt: list[int], output_len: int, lora: LoRARequest | None) -> float:
    """Batch-1 decode tokens per second: one request run to `output_len` tokens and to 8, the difference over the
    tokens between (the prefill and the first steps cancel out: the bar is about decode)."""
    elapsed = {}
    for tokens in (output_len, 8):
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        llm.engine.reset_prefix_cache(quiet=True)
        start = time.perf_counter()
        llm.generate([prompt], params, lora_request=[lora]) if lora else llm.generate([prompt], params)
        elapsed[tokens] = time.perf_counter() - start
    return (output_len - 8) / (elapsed[output_len] - elapsed[8])


def offline(args: argparse.Namespace, adapters: list[Path]) -> dict[str, float]:
    params = SamplingParams(max_tokens=args.len, temperature=0.0, ignore_eos=True)
    base = LLM("default", max_num_seqs=args.requests, num_threads=args.threads or None)
    prompts = prompts_of(args.requests, args.len, VOCAB)
    requests = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    spread = [requests[i % len(requests)] for i in range(args.requests)]
    timed(base, prompts[:2], params, None)  # warm-up: kernel choices, captures
    lora = LLM(
        "default",
        max_num_seqs=args.requests,
        enable_lora=True,
        max_loras=len(adapters),
        max_lora_rank=args.rank,
        num_threads=args.threads or None,
        lora_dtype=args.lora_dtype,
    )
    timed(lora, prompts[:4], params, spread[:4])
    n = args.requests
    runs: dict[str, list[float]] = {}
    for _ in range(args.repeats):  # base and LoRA in turn: the machine's other load falls on both alike
        runs.setdefault(f"base {n} req tok/s", []).append(timed(base, prompts, params, None))
        runs.setdefault(f"lora {n} req tok/s", []).append(timed(lora, prompts, params, spread))
        runs.setdefault("base bs1 tok/s", []).append(decode_rate(base, prompts[0], args.len, None))
        runs.setdefault("lora bs1 tok/s", []).append(decode_rate(lora, prompts[0], args.len, spread[0]))
    results = {name: statistics.median(times) for name, times in runs.items()}
    return with_ratios(results, n)


def with_ratios(results: dict, n: int) -> dict:
    """`results` with LoRA's throughput over the base's, for the batch and for one request."""
    if f"lora {n} req tok/s" not in results:
        return results
    ratios = {
        f"{n} req ratio": results[f"lora {n} req tok/s"] / results[f"base {n} req tok/s"],
        "bs1 ratio": results["lora bs1 tok/s"] / results["base bs1 tok/s"],
    }
    return results | ratios


def threads_of(args: argparse.Namespace) -> int:
    return args.threads or len(os.sched_getaffinity(0))


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
        body = {"model": "default", "prompt": "Once upon a time", "max_tokens": 256, "ignore_eos": True}

        def stream(times: list[float]) -> None:
            with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=600) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        times.append(time.perf_counter())

        def gaps_of(times: list[float]) -> list[float]:
            return [b - a for a, b in itertools.pairwise(times)]

        alone: list[float] = []  # the same stream with no load beside it: the server's own jitter
        stream(alone)
        times: list[float] = []
        reader = threading.Thread(target=stream, args=(times,))
        reader.start()
        while len(times) < 64:
            time.sleep(0.01)
        start = time.perf_counter()
        answer = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(adapters[0])})
        load_s = time.perf_counter() - start
        assert answer.status_code == 200, answer.text
        reader.join()
        return {
            "load s": load_s,
            "largest gap s": max(gaps_of(times)),
            "median gap s": statistics.median(gaps_of(times)),
            "largest gap without a load s": max(gaps_of(alone)),
        }
    finally:
        server.terminate()
        server.wait(timeout=60)


VLLM_WORKER = Path(__file__).with_name("lora_vllm_worker.py")


def vllm(args: argparse.Namespace, adapters: list[Path]) -> dict[str, float | str]:
    """The same timings on vLLM's CPU build (scripts/lora_vllm_worker.py in vLLM's own environment: .venv-vllm, or
    $KILN_VLLM_PYTHON) on its bf16 HF copy of the default model; {"refused": its last error line} if it fails."""
    check_vllm()
    with tempfile.TemporaryDirectory(prefix="kiln-vllm-lora-") as tmp:
        request, result = Path(tmp) / "request.json", Path(tmp) / "result.json"
        spec = {
            "model_dir": str(hf_dir_for(resolve_model_path("default"))),
            "dtype": DTYPE,
            "adapters": [str(p) for p in adapters],
            "rank": args.rank,
            "len": args.len,
            "prompts": prompts_of(args.requests, args.len, VOCAB),
        }
        request.write_text(json.dumps(spec))
        proc = subprocess.run(
            [str(vllm_python()), str(VLLM_WORKER), str(request), str(result)],
            env=worker_env(threads_of(args)),
            capture_output=True,
            text=True,
            timeout=3600,
        )
        if proc.returncode != 0 or not result.exists():
            lines = proc.stderr.strip().splitlines() or ["(no output)"]
            print("\n".join(lines[-40:]), file=sys.stderr)
            return {"refused": lines[-1]}
        return json.loads(result.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--len", type=int, default=128)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0, help="both engines' threads (default: every CPU allowed)")
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
            report["vllm"] = with_ratios(vllm(args, adapters), args.requests)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
