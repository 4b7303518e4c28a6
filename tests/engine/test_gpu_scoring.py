"""Prompt logprobs and embeddings on CUDA (issue 53), in the default graph mode: the prefill's rows come from the
pieces' CUDA graphs and the decodes from the full decode graph, and both equal HF transformers' on the same float32
model within 1e-4 (the CPU versions: tests/engine/test_prompt_logprobs.py, test_embeddings.py). Run by
scripts/gpu_check.sh on a lent GPU machine; skipped elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln import LLM, SamplingParams
from tests.engine.test_embeddings import assert_hf_embedding
from tests.engine.test_prompt_logprobs import FP32, PROMPTS, TOP, assert_hf_prompt_logprobs
from tests.engine.tiny_models import write_hf_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("tiny_llama_gpu_scoring")
    return path, write_hf_model(path, "llama", perturb=0.05)


def test_prompt_logprobs_and_embeddings_on_cuda_graphs_equal_hf(tiny: tuple[Path, torch.nn.Module]) -> None:
    path, hf = tiny
    cuda = dict(device="cuda", capture_sizes=(1, 2, 4), **{k: v for k, v in FP32.items() if k != "activations"})
    llm = LLM(str(path), graph_mode="full_and_piecewise", **cuda)
    asking = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=TOP)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, asking), strict=True):
        assert out.prompt_logprobs is not None
        assert_hf_prompt_logprobs(hf, prompt, out.prompt_logprobs)
    for prompt, out in zip(PROMPTS, llm.embed(PROMPTS), strict=True):
        assert_hf_embedding(hf, prompt, out.outputs.embedding, "last")
    counters = llm.engine.executor.counters
    assert counters.replays > 0 and counters.full_replays > 0  # pieces for the prefills, the full graph decoding
