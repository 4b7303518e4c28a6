"""Loaders: every supported GGUF type, HF directories of each family (logits vs HF transformers), bad files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.bench.hf_runner import load_hf_model
from kiln.errors import ModelLoadError
from kiln.model.build import build_model
from kiln.model.loader import open_checkpoint
from tests.engine.tiny_models import write_gguf_model, write_hf_model

PROMPT = [5, 17, 42, 7, 99, 3, 61, 250, 11]


def kiln_prompt_logits(model_path: str, ids: list[int]) -> torch.Tensor:
    llm = LLM(model_path, num_kv_blocks=16, graph_mode="eager", kv_cache_dtype="float32")  # HF's logits at 1e-4
    engine = llm.engine
    engine.add_request("r", ids, SamplingParams(max_tokens=1, temperature=0))
    inputs = engine.runner.prepare(engine.scheduler.schedule())
    return engine.model.compute_logits(engine.runner.forward(inputs)[: len(ids)])


@pytest.mark.parametrize(
    "family,overrides",
    [
        ("llama", {}),
        (
            "llama",
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            },
        ),
        ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
        ("llama", {"tie_word_embeddings": True}),
        ("qwen2", {}),
        ("mistral", {}),
    ],
)
def test_hf_directory_matches_transformers(tmp_path: Path, family: str, overrides: dict) -> None:
    hf = write_hf_model(tmp_path, family, **overrides)
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0]
    got = kiln_prompt_logits(str(tmp_path), PROMPT)
    assert (got - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("tensor_type", ["F32", "F16", "Q8_0", "Q4_0", "Q4_1"])
def test_gguf_types_match_transformers(tmp_path: Path, tensor_type: str) -> None:
    """HF transformers dequantizes the same file its own way; both must give the same logits."""
    path = tmp_path / f"tiny-{tensor_type}.gguf"
    write_gguf_model(path, tensor_type)
    hf = load_hf_model(str(path), "float32", "cpu")
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0]
    got = kiln_prompt_logits(str(path), PROMPT)
    assert (got - expected).abs().max().item() < 1e-4


def test_missing_file_names_the_path() -> None:
    with pytest.raises(ModelLoadError, match=r"/nowhere/model.gguf: no such file or directory"):
        open_checkpoint("/nowhere/model.gguf")


def test_truncated_gguf_names_file_and_tensor(tmp_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    write_gguf_model(path, "Q8_0")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(ModelLoadError) as err:
        open_checkpoint(str(path))
    message = str(err.value)
    assert str(path) in message and "truncated" in message and "\n" not in message


def test_garbage_file_is_not_a_model(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(256))
    with pytest.raises(ModelLoadError, match="unknown model file"):
        open_checkpoint(str(path))
    bad_gguf = tmp_path / "bad.gguf"
    bad_gguf.write_bytes(b"GGUF" + os.urandom(64))
    with pytest.raises(ModelLoadError, match=str(bad_gguf)):
        open_checkpoint(str(bad_gguf))


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    write_gguf_model(path, "F32", arch="gpt2")
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'gpt2'"):
        open_checkpoint(str(path)).config  # noqa: B018


def test_unsupported_quantization_type(tmp_path: Path) -> None:
    path = tmp_path / "f64.gguf"
    write_gguf_model(path, "F64")
    with pytest.raises(ModelLoadError, match=r"unsupported tensor type F64"):
        build_model(open_checkpoint(str(path)), torch.float32, 64)


def test_hf_directory_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"config\.json is missing"):
        open_checkpoint(str(tmp_path))
    write_hf_model(tmp_path, "llama")
    shard = next(tmp_path.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-64])
    with pytest.raises(ModelLoadError, match="truncated"):
        open_checkpoint(str(tmp_path))


def test_unsupported_hf_architecture(tmp_path: Path) -> None:
    write_hf_model(tmp_path, "llama")
    cfg = (tmp_path / "config.json").read_text().replace("LlamaForCausalLM", "GPT2LMHeadModel")
    (tmp_path / "config.json").write_text(cfg)
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        open_checkpoint(str(tmp_path)).config  # noqa: B018


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_dtypes_run(tmp_path: Path, dtype: str) -> None:
    write_hf_model(tmp_path, "llama")
    ref = LLM(str(tmp_path), num_kv_blocks=16, graph_mode="eager").generate(
        PROMPT, SamplingParams(max_tokens=4, temperature=0)
    )[0]
    out = LLM(str(tmp_path), dtype=dtype, num_kv_blocks=16, graph_mode="eager").generate(
        PROMPT, SamplingParams(max_tokens=4, temperature=0)
    )
    assert out[0].finish_reason == "length" and len(out[0].token_ids) == 4
    assert out[0].token_ids[0] == ref.token_ids[0]
