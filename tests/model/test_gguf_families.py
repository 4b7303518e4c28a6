"""GGUF files of each family llama.cpp defines: kiln's logits against HF transformers' own GGUF loading.

Each file is tiny and random, written with gguf.GGUFWriter in llama.cpp's tensor naming and metadata keys. Where
transformers' GGUF loader reads no metadata for a setting (Qwen3's head_dim, the Qwen MoE expert widths, Gemma's
head_dim and query scale), the file uses transformers' default, so both read the same model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kiln.bench.hf_runner import load_hf_model
from kiln.errors import ModelLoadError
from kiln.model.loader import open_checkpoint
from tests.engine.parity import kiln_batch_logits
from tests.engine.tiny_models import add_gguf_tensor, add_toy_gguf_tokenizer, write_gguf_file

PROMPTS = [[5, 17, 42, 7, 99, 3, 61, 250, 11], [8, 1, 130, 77]]
H, HEADS, KV, FF, VOCAB = 64, 4, 2, 128, 256


def _attention(head_dim: int, bias: bool = False, qk_norm: bool = False) -> dict[str, tuple[int, ...]]:
    q, kv = HEADS * head_dim, KV * head_dim
    shapes = {"attn_q.weight": (q, H), "attn_k.weight": (kv, H), "attn_v.weight": (kv, H), "attn_output.weight": (H, q)}
    if bias:
        shapes |= {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)}
    if qk_norm:
        shapes |= {"attn_q_norm.weight": (head_dim,), "attn_k_norm.weight": (head_dim,)}
    return shapes


MLP = {"ffn_gate.weight": (FF, H), "ffn_up.weight": (FF, H), "ffn_down.weight": (H, FF)}
NORMS = {"attn_norm.weight": (H,), "ffn_norm.weight": (H,)}
GEMMA_NORMS = NORMS | {"post_attention_norm.weight": (H,), "post_ffw_norm.weight": (H,)}


def _experts(num: int, width: int) -> dict[str, tuple[int, ...]]:
    return {
        "ffn_gate_inp.weight": (num, H),
        "ffn_gate_exps.weight": (num, width, H),
        "ffn_up_exps.weight": (num, width, H),
        "ffn_down_exps.weight": (num, H, width),
    }


# family -> (GGUF arch, `{arch}.*` metadata beyond the shared keys, per-layer tensor shapes, tied embedding)
FAMILIES: dict[str, tuple[str, dict[str, Any], dict[str, tuple[int, ...]], bool]] = {
    "qwen2": ("qwen2", {}, NORMS | _attention(16, bias=True) | MLP, False),
    # transformers' GGUF Qwen3 keeps its default head_dim (128)
    "qwen3": ("qwen3", {"attention.key_length": 128}, NORMS | _attention(128, qk_norm=True) | MLP, False),
    "phi3": (
        "phi3",
        {},
        NORMS
        | {"attn_qkv.weight": (H + 2 * KV * 16, H), "attn_output.weight": (H, H)}
        | {"ffn_up.weight": (2 * FF, H), "ffn_down.weight": (H, FF)},
        False,
    ),
    # transformers' GGUF Gemma keeps its default head_dim and query_pre_attn_scalar (256) and soft-caps (50, 30)
    "gemma2": (
        "gemma2",
        {
            "attention.key_length": 256,
            "attention.sliding_window": 4,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
        },
        GEMMA_NORMS | _attention(256) | MLP,
        True,
    ),
    "gemma3": (
        "gemma3",
        {"attention.key_length": 256, "attention.sliding_window": 4, "rope.freq_base": 1e6, "block_count": 6},
        GEMMA_NORMS | _attention(256, qk_norm=True) | MLP,
        True,
    ),
    # transformers' GGUF Qwen MoE keep their default expert widths (Qwen2: 1408 and a 5632 shared expert; Qwen3: 768)
    "qwen2_moe": (
        "qwen2moe",
        {"expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 1408}
        | {"expert_shared_feed_forward_length": 5632},
        NORMS
        | _attention(16, bias=True)
        | _experts(4, 1408)
        | {"ffn_gate_shexp.weight": (5632, H), "ffn_up_shexp.weight": (5632, H), "ffn_down_shexp.weight": (H, 5632)}
        | {"ffn_gate_inp_shexp.weight": (H,)},
        False,
    ),
    "qwen3_moe": (
        "qwen3moe",
        {"expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 768, "attention.key_length": 16},
        NORMS | _attention(16, qk_norm=True) | _experts(4, 768),
        False,
    ),
}


def write_gguf(
    path: Path,
    arch: str,
    settings: dict[str, Any],
    tensors: dict[str, np.ndarray],
    tensor_type: str,
    keep_f32: tuple[str, ...] = (),
) -> None:
    """A GGUF of llama.cpp architecture `arch`: `{arch}.*` metadata `settings` (int -> uint32, float -> float32), a
    toy tokenizer, and `tensors`, each matrix stored as `tensor_type` unless its name contains one of `keep_f32`
    (vectors stay F32)."""
    from gguf import GGMLQuantizationType, GGUFWriter

    w = GGUFWriter(str(path), arch)
    for key, value in settings.items():
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"{arch}.{key}", value)
    add_toy_gguf_tokenizer(w, VOCAB)
    w.add_pad_token_id(0)
    qtype = GGMLQuantizationType[tensor_type]
    for name, data in tensors.items():
        f32 = data.ndim == 1 or any(k in name for k in keep_f32)
        add_gguf_tensor(w, name, data, GGMLQuantizationType.F32 if f32 else qtype)
    write_gguf_file(w)


def write_family_gguf(path: Path, family: str, tensor_type: str) -> None:
    """A tiny random GGUF of `family` (a FAMILIES key): weight matrices as `tensor_type`, vectors F32."""
    arch, metadata, layer_shapes, tied = FAMILIES[family]
    rng = np.random.default_rng(0)
    settings = {
        "block_count": 2,
        "context_length": 512,
        "embedding_length": H,
        "feed_forward_length": FF,
        "attention.head_count": HEADS,
        "attention.head_count_kv": KV,
        "rope.freq_base": 10000.0,
        "attention.layer_norm_rms_epsilon": 1e-6,
        "vocab_size": VOCAB,
    } | metadata
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (VOCAB, H)}
    for i in range(settings["block_count"]):
        shapes |= {f"blk.{i}.{name}": shape for name, shape in layer_shapes.items()}
    shapes |= {"output_norm.weight": (H,)} | ({} if tied else {"output.weight": (VOCAB, H)})
    tensors = {}
    for name, shape in shapes.items():
        scale = 0.5 if "gate_inp" in name else 0.05  # routers spread enough to route tokens apart
        tensors[name] = (rng.standard_normal(shape) * scale).astype(np.float32)
        if name.endswith("norm.weight"):
            tensors[name] += 1.0
    write_gguf(path, arch, settings, tensors, tensor_type)


# NOTE: Q8_0 where it loads differently: packed fused qkv (phi3), the soft-capped head over a packed embedding
# (gemma2), quantized 3-D expert stacks (qwen3_moe), an unpermuted packed q/k (qwen3); the rest in F32 only, to
# keep the first run's per-machine kernel timing of every new packed shape short
CASES = [(family, "F32") for family in FAMILIES] + [(f, "Q8_0") for f in ("qwen3", "phi3", "gemma2", "qwen3_moe")]


@pytest.mark.parametrize("family,tensor_type", CASES)
def test_gguf_family_matches_transformers(tmp_path: Path, family: str, tensor_type: str) -> None:
    path = tmp_path / f"{family}-{tensor_type}.gguf"
    write_family_gguf(path, family, tensor_type)
    assert open_checkpoint(str(path)).config.architecture == family
    hf = load_hf_model(str(path), "float32", "cpu")
    with torch.no_grad():
        expected = [hf(torch.tensor([ids])).logits[0] for ids in PROMPTS]
    got = kiln_batch_logits(str(path), PROMPTS)
    for g, e in zip(got, expected, strict=True):
        assert (g - e).abs().max().item() < 1e-4


@pytest.mark.parametrize("metadata", [{}, {"expert_count": 0}])
def test_unknown_expert_layout_names_the_family(tmp_path: Path, metadata: dict[str, Any]) -> None:
    """Expert stacks in a "llama" file without llama.expert_count, or with 0 (llama.cpp builds dense MLPs then):
    refused, naming the tensor and the names kiln reads (with experts it is Mixtral: test_gguf_from_hf.py)."""
    from tests.engine.tiny_models import write_gguf_model

    path = tmp_path / "mixtral.gguf"
    write_gguf_model(path, tensor_shapes={"blk.0.ffn_gate_exps.weight": (4, 128, 64)}, metadata=metadata)
    with pytest.raises(ModelLoadError, match=r"unknown tensor blk\.0\.ffn_gate_exps\.weight: kiln reads llama"):
        open_checkpoint(str(path)).weight_shapes()


def test_messages_name_tensors_as_the_file_does() -> None:
    from kiln.model.loader.families import gguf_layout
    from kiln.model.loader.gguf_layout import gguf_name

    moe, gemma = gguf_layout("qwen3_moe"), gguf_layout("gemma2")
    assert gguf_name(moe, "model.layers.1.mlp.experts.3.down_proj.weight") == "blk.1.ffn_down_exps.weight (expert 3)"
    assert gguf_name(gemma, "model.layers.0.pre_feedforward_layernorm.weight") == "blk.0.ffn_norm.weight"
    assert gguf_name(gemma, "model.norm.weight") == "output_norm.weight"


@pytest.mark.parametrize(
    "family,modules",
    [
        ("phi3", {"qkv_proj", "gate_up_proj", "o_proj", "down_proj"}),
        ("gemma2", {"pre_feedforward_layernorm", "post_feedforward_layernorm", "q_proj", "gate_up_proj"}),
        ("qwen2_moe", {"gate", "gate_proj", "shared_expert_gate", "qkv_proj"}),
    ],
)
def test_recipe_names_a_gguf_files_modules_in_its_familys_naming(tmp_path: Path, family: str, modules: set) -> None:
    """The recipe's fusion groups name modules as the model class does: a GGUF file's tensors are named through
    its family's table (Phi-3's fused qkv, Gemma's sandwich norms, the MoE router and experts), not Llama's."""
    from kiln.recipe.checkpoint import model_ops, read_header

    path = tmp_path / f"{family}.gguf"
    write_family_gguf(path, family, "F32")
    ops = model_ops(read_header(str(path)))
    assert modules <= ops and "" not in ops
