"""Malformed checkpoints: each is one ModelLoadError naming the file (and the tensor or field), never a traceback
and never a model with random weights. HF directories and GGUF files alike, plus the CLI's one-line report."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGUFReader

from kiln.errors import ModelLoadError
from kiln.model.build import build_model
from kiln.model.llama import LlamaForCausalLM, WeightMismatch
from kiln.model.loader import open_checkpoint
from tests.engine.tiny_models import rewrite_config, rewrite_safetensors, write_gguf_model, write_hf_model

K_PROJ = "model.layers.0.self_attn.k_proj.weight"


def load(path: Path) -> ModelLoadError:
    """Load `path` the way the engine does; returns the ModelLoadError it must raise."""
    with pytest.raises(ModelLoadError) as err:
        build_model(open_checkpoint(str(path)), torch.float32, 64, "cpu")
    assert "\n" not in str(err.value)
    return err.value


@pytest.fixture(scope="module")
def good_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("good-hf")
    write_hf_model(directory, "llama")
    return directory


@pytest.fixture
def hf_dir(good_hf_dir: Path, tmp_path: Path) -> Path:
    """A fresh copy of a valid tiny HF directory, for one test to break."""
    return Path(shutil.copytree(good_hf_dir, tmp_path / "model"))


def shard_of(directory: Path) -> Path:
    (shard,) = directory.glob("*.safetensors")
    return shard


# --- HF: safetensors files ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("keep_bytes", [4, 8 + 20])
def test_hf_safetensors_header_cut_short(hf_dir: Path, keep_bytes: int) -> None:
    shard = shard_of(hf_dir)
    shard.write_bytes(shard.read_bytes()[:keep_bytes])
    err = load(hf_dir)
    assert err.path == str(shard) and "truncated" in err.problem


def test_hf_safetensors_data_cut_short_names_last_tensor(hf_dir: Path) -> None:
    shard = shard_of(hf_dir)
    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = {k: v for k, v in json.loads(data[8 : 8 + n]).items() if k != "__metadata__"}
    last = max(header, key=lambda name: header[name]["data_offsets"][1])
    shard.write_bytes(data[:-64])
    err = load(hf_dir)
    assert err.path == str(shard) and "truncated" in err.problem and f"tensor {last} " in err.problem


def test_hf_safetensors_header_disagrees_with_shape(hf_dir: Path) -> None:
    shard = shard_of(hf_dir)
    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header[K_PROJ]["shape"] = [16, 64]  # the stored bytes hold [32, 64]
    text = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(text) == n
    shard.write_bytes(data[:8] + text + data[8 + n :])
    err = load(hf_dir)
    assert err.path == str(shard) and "corrupt" in err.problem and K_PROJ in err.problem


def test_hf_unsupported_dtype_names_file_and_tensor(hf_dir: Path) -> None:
    shard = rewrite_safetensors(hf_dir, lambda t: t.update({K_PROJ: t[K_PROJ].double()}))
    err = load(hf_dir)
    assert err.path == str(shard) and "unsupported tensor dtype F64" in err.problem and K_PROJ in err.problem


def test_hf_wrong_shape_names_file_and_tensor(hf_dir: Path) -> None:
    shard = rewrite_safetensors(hf_dir, lambda t: t.update({K_PROJ: t[K_PROJ][:16].clone()}))
    err = load(hf_dir)
    assert err.path == str(shard)
    assert f"tensor {K_PROJ}: shape (16, 64), but the config implies (32, 64)" in err.problem


def test_hf_missing_tensor_names_it(hf_dir: Path) -> None:
    rewrite_safetensors(hf_dir, lambda t: t.pop("model.norm.weight"))
    err = load(hf_dir)
    assert err.path == str(hf_dir) and "tensor model.norm.weight: missing" in err.problem


@pytest.mark.parametrize(
    "part,fused",
    [
        (K_PROJ, "qkv_proj"),
        ("model.layers.1.self_attn.v_proj.weight", "qkv_proj"),
        ("model.layers.0.mlp.up_proj.weight", "gate_up_proj"),
    ],
)
def test_hf_missing_part_of_fused_weight_names_the_part(hf_dir: Path, part: str, fused: str) -> None:
    rewrite_safetensors(hf_dir, lambda t: t.pop(part))
    err = load(hf_dir)
    assert err.path == str(hf_dir) and f"tensor {part}: missing" in err.problem and fused in err.problem


@pytest.mark.parametrize(
    "extra", ["model.layers.0.mlp.extra_proj.weight", "model.layers.2.input_layernorm.weight", "score.weight"]
)
def test_hf_unknown_tensor_names_file_and_tensor(hf_dir: Path, extra: str) -> None:
    shard = rewrite_safetensors(hf_dir, lambda t: t.update({extra: torch.zeros(64)}))
    err = load(hf_dir)
    assert err.path == str(shard) and f"tensor {extra}: unexpected" in err.problem


def test_hf_tensor_stored_in_two_shards(hf_dir: Path) -> None:
    from safetensors.torch import save_file

    save_file({"model.norm.weight": torch.ones(64)}, str(hf_dir / "model-extra.safetensors"))
    err = load(hf_dir)
    assert "model.norm.weight" in err.problem and "stored once" in err.problem


# --- HF: config.json ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content,problem",
    [
        (b'{"hidden_size": \xff\xfe}', "not UTF-8"),
        (b'{"hidden_size": 64,', "invalid JSON"),
        (b"[1, 2, 3]", "expected a JSON object"),
    ],
)
def test_hf_config_unreadable(hf_dir: Path, content: bytes, problem: str) -> None:
    (hf_dir / "config.json").write_bytes(content)
    err = load(hf_dir)
    assert err.path == str(hf_dir / "config.json") and problem in err.problem


@pytest.mark.parametrize(
    "changes,remove,expected",
    [
        ({"num_attention_heads": 0}, (), "field num_attention_heads must be a positive integer, found 0"),
        ({"hidden_size": "64"}, (), "field hidden_size must be a positive integer, found '64'"),
        ({"num_hidden_layers": True}, (), "field num_hidden_layers must be a positive integer, found True"),
        ({}, ("vocab_size",), "field vocab_size is missing (expected a positive integer)"),
        ({}, ("intermediate_size",), "field intermediate_size is missing"),
        (
            {"num_attention_heads": 5, "num_key_value_heads": 5},
            ("head_dim",),
            "field hidden_size (64) is not divisible by num_attention_heads (5)",
        ),
        ({"num_key_value_heads": 3}, (), "num_attention_heads (4) is not divisible by num_key_value_heads (3)"),
        ({"rms_norm_eps": -1}, (), "field rms_norm_eps must be a positive number, found -1"),
        ({"tie_word_embeddings": "yes"}, (), "field tie_word_embeddings must be true or false, found 'yes'"),
        ({"eos_token_id": "</s>"}, (), "field eos_token_id must be a token id"),
        ({"architectures": "LlamaForCausalLM"}, (), "field architectures must be a list"),
        ({"rope_parameters": "linear"}, (), "field rope_parameters must be an object"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, (), "field rope_parameters.rope_type is 'yarn'"),
        ({"rope_parameters": {"rope_type": "linear"}}, (), "field rope_parameters.factor is missing"),
    ],
)
def test_hf_config_bad_field_names_it(hf_dir: Path, changes: dict[str, Any], remove: tuple, expected: str) -> None:
    config = rewrite_config(hf_dir, changes, remove)
    err = load(hf_dir)
    assert err.path == str(config) and expected in err.problem


# --- GGUF --------------------------------------------------------------------------------------------------------


def tensor_ends(path: Path) -> dict[str, int]:
    """Tensor name -> the byte its data ends at."""
    return {t.name: int(t.data_offset) + int(t.n_bytes) for t in GGUFReader(str(path)).tensors}


@pytest.mark.parametrize("keep", ["magic", "metadata", "tensor infos", "data"])
def test_gguf_cut_short(tmp_path: Path, keep: str) -> None:
    path = tmp_path / "cut.gguf"
    write_gguf_model(path, "Q8_0")
    data = path.read_bytes()
    ends = tensor_ends(path)
    first_data = min(ends.values()) - (64 * 256 // 32) * 34  # token_embd (Q8_0: 34 bytes per 32 values) comes first
    cut = {"magic": 3, "metadata": 200, "tensor infos": first_data - 40, "data": len(data) - 100}[keep]
    path.write_bytes(data[:cut])
    err = load(path)
    assert err.path == str(path)
    assert "truncated" in err.problem or "cut short" in err.problem
    if keep == "data":
        assert f"tensor {max(ends, key=ends.__getitem__)} " in err.problem


def test_gguf_unsupported_type_names_file_and_tensor(tmp_path: Path) -> None:
    path = tmp_path / "f64.gguf"
    write_gguf_model(path, "F64")
    err = load(path)
    assert err.path == str(path) and "unsupported tensor type F64 (tensor token_embd.weight" in err.problem


def test_gguf_wrong_shape_names_tensor(tmp_path: Path) -> None:
    path = tmp_path / "shape.gguf"
    write_gguf_model(path, tensor_shapes={"blk.1.attn_k.weight": (16, 64)})
    err = load(path)
    assert err.path == str(path)
    assert "tensor blk.1.attn_k.weight: shape (16, 64), but the config implies (32, 64)" in err.problem


def test_gguf_missing_tensor_names_it(tmp_path: Path) -> None:
    path = tmp_path / "missing.gguf"
    write_gguf_model(path, tensor_shapes={"output_norm.weight": None})
    err = load(path)
    assert err.path == str(path) and "tensor output_norm.weight: missing" in err.problem


@pytest.mark.parametrize("part,fused", [("blk.0.attn_k.weight", "qkv_proj"), ("blk.1.ffn_up.weight", "gate_up_proj")])
def test_gguf_missing_part_of_fused_weight_names_the_part(tmp_path: Path, part: str, fused: str) -> None:
    path = tmp_path / "part.gguf"
    write_gguf_model(path, tensor_shapes={part: None})
    err = load(path)
    assert err.path == str(path) and f"tensor {part}: missing" in err.problem and fused in err.problem


@pytest.mark.parametrize(
    "extra,problem",
    [
        ("blk.0.ffn_gate_inp.weight", "unknown tensor blk.0.ffn_gate_inp.weight"),
        ("blk.2.attn_norm.weight", "tensor blk.2.attn_norm.weight: unexpected"),
    ],
)
def test_gguf_unknown_tensor_names_it(tmp_path: Path, extra: str, problem: str) -> None:
    path = tmp_path / "extra.gguf"
    write_gguf_model(path, tensor_shapes={extra: (64,)})
    err = load(path)
    assert err.path == str(path) and problem in err.problem


@pytest.mark.parametrize(
    "metadata,expected",
    [
        ({"attention.head_count": 0}, "field llama.attention.head_count must be a positive integer, found 0"),
        ({"embedding_length": "64"}, "field llama.embedding_length must be a positive integer, found '64'"),
        (
            {"attention.head_count": 5, "attention.head_count_kv": 5},
            "field llama.embedding_length (64) is not divisible by llama.attention.head_count (5)",
        ),
    ],
)
def test_gguf_bad_metadata_names_the_key(tmp_path: Path, metadata: dict[str, Any], expected: str) -> None:
    path = tmp_path / "meta.gguf"
    write_gguf_model(path, metadata=metadata)
    err = load(path)
    assert err.path == str(path) and expected in err.problem


# --- the model itself, and the CLI ------------------------------------------------------------------------------


def test_load_weights_never_leaves_a_fused_part_random(hf_dir: Path) -> None:
    """Without the header check, a weight stream lacking k still fails: qkv_proj is never part random."""
    checkpoint = open_checkpoint(str(hf_dir))
    model = LlamaForCausalLM(checkpoint.config, 64)
    weights = ((name, tensor) for name, tensor in checkpoint.weights() if name != K_PROJ)
    with pytest.raises(WeightMismatch, match=rf"tensor {K_PROJ}: missing from the checkpoint \(one part of"):
        model.load_weights(weights)


def break_hf_k_proj(directory: Path) -> None:
    rewrite_safetensors(directory, lambda t: t.pop(K_PROJ))


def break_hf_config(directory: Path) -> None:
    (directory / "config.json").write_bytes(b"\xff\xfe not json")


@pytest.mark.parametrize("break_model", [break_hf_k_proj, break_hf_config])
def test_cli_reports_bad_checkpoint_in_one_line(hf_dir: Path, break_model: Callable[[Path], None]) -> None:
    break_model(hf_dir)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kiln.cli",
            "generate",
            "--graph-mode",
            "eager",
            "--model",
            str(hf_dir),
            "--prompt",
            "hi",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("kiln: error:")]
    assert len(errors) == 1 and str(hf_dir) in errors[0]
