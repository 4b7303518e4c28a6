"""Each rank reads only its part of an HF checkpoint: a tensor-parallel rank narrows every split tensor as it reads it
(safetensors slices), a pipeline stage never reads another stage's layers, and both give one process's results on a
tiny Qwen2 (q/k/v biases, a vocabulary that does not split evenly)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kiln import LLM
from kiln.engine.request import RequestOutput
from kiln.engine.sampling.sampling_params import SamplingParams
from kiln.model.loader.hf_loader import TensorReader
from tests.distributed.test_tensor_parallel import assert_same
from tests.engine.tiny_models import write_hf_model

PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], [100, 200, 42, 17]]
GREEDY = SamplingParams(max_tokens=6, temperature=0, logprobs=3)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = tmp_path_factory.mktemp("qwen2")
    write_hf_model(directory, "qwen2", vocab_size=251, perturb=0.05)
    return str(directory)


@pytest.fixture(scope="module")
def reference(checkpoint: str) -> list[RequestOutput]:
    with LLM(checkpoint, seed=0, graph_mode="eager") as llm:
        return llm.generate(PROMPTS, GREEDY)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """How this process (rank 0) read each checkpoint tensor: "whole" or "part"."""
    seen: dict[str, str] = {}
    whole, narrow = TensorReader.whole, TensorReader.narrow

    def read_whole(self: TensorReader) -> object:
        seen[self.name] = "whole"
        return whole(self)

    def read_part(self: TensorReader, dim: int, start: int, length: int) -> object:
        seen[self.name] = "part"
        return narrow(self, dim, start, length)

    monkeypatch.setattr(TensorReader, "whole", read_whole)
    monkeypatch.setattr(TensorReader, "narrow", read_part)
    yield seen


def test_tensor_parallel_reads_parts(checkpoint: str, reference: list[RequestOutput], reads: dict[str, str]) -> None:
    with LLM(checkpoint, seed=0, tensor_parallel_size=2, graph_mode="eager") as llm:
        outputs = llm.generate(PROMPTS, GREEDY)
    assert_same(outputs, reference, 1e-4)
    split = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head")
    assert {n for n, how in reads.items() if how == "part"} == {n for n in reads if any(s in n for s in split)}
    assert reads["model.layers.0.self_attn.q_proj.bias"] == "part"
    assert reads["model.norm.weight"] == "whole"


def test_pipeline_stage_reads_its_layers_only(
    checkpoint: str, reference: list[RequestOutput], reads: dict[str, str]
) -> None:
    with LLM(checkpoint, seed=0, pipeline_parallel_size=2, graph_mode="eager") as llm:
        outputs = llm.generate(PROMPTS, GREEDY)
    assert_same(outputs, reference, 1e-4)
    assert any(n.startswith("model.layers.0.") for n in reads)
    assert not any(n.startswith(("model.layers.1.", "model.norm.", "lm_head.")) for n in reads)
