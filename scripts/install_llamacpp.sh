#!/usr/bin/env bash
# Builds llama-cpp-python (the anchor of `kiln bench --compare llama.cpp`) into .venv from source.
# Optional: ~7 minutes on 2 cores, so it is not part of `make setup`. `make llamacpp` calls this.
# ggml's -march=native build dies on some VMs with SIGILL in its AMX kernel (tilezero), so the
# build names the ISA the CPU reports instead of asking for "native", and leaves AMX out.
set -euo pipefail
BIN=${BIN:-.venv/bin}
flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
has() { [[ " $flags " == *" $1 "* ]] && echo ON || echo OFF; }
args="-DGGML_NATIVE=OFF -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma) -DGGML_F16C=$(has f16c)"
args+=" -DGGML_AVX512=$(has avx512f) -DGGML_AVX512_VNNI=$(has avx512_vnni) -DGGML_AVX512_BF16=$(has avx512_bf16)"
args+=" -DGGML_AVX512_VBMI=$(has avx512vbmi) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
args+=" -DGGML_OPENMP=ON -DLLAMA_CURL=OFF"
echo "CMAKE_ARGS=$args"
CMAKE_ARGS="$args" "$BIN/pip" install --no-cache-dir -v "llama-cpp-python==0.3.36"
