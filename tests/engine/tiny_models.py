"""Small random checkpoints written to disk, so loaders and families are tested without any hub."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kiln.model.loader import default_model_path

# family -> HF (config class, model class), built from transformers' own code (nothing is downloaded)
HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def default_tokenizer_json() -> str:
    """The default model's tokenizer as tokenizer.json text (vocab 49152)."""
    from kiln.model.loader import GGUFCheckpoint
    from kiln.model.tokenizer import KilnTokenizer

    return KilnTokenizer.from_gguf(GGUFCheckpoint(default_model_path())).tokenizer.to_str()


def write_hf_model(
    directory: Path, family: str, vocab_size: int = 256, perturb: float = 0.0, **overrides
) -> torch.nn.Module:
    """Save a tiny random HF transformers model (a `HF_CLASSES` family) with a tokenizer; returns the HF model.
    `perturb` > 0 adds that much noise to every parameter (HF initialises norms to one and routers to zero)."""
    import transformers

    config_cls, model_cls = (getattr(transformers, name) for name in HF_CLASSES[family])
    torch.manual_seed(0)
    config = config_cls(vocab_size=vocab_size, **{"max_position_embeddings": 512, **TINY, **overrides})
    model = model_cls(config).eval()
    with torch.no_grad():
        for param in model.parameters() if perturb else ():
            param.add_(torch.randn_like(param) * perturb)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tok = json.loads(default_tokenizer_json())
    (directory / "tokenizer.json").write_text(json.dumps(tok))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": None}))
    return model


def rewrite_safetensors(directory: Path, edit: Callable[[dict[str, torch.Tensor]], object]) -> Path:
    """Load the directory's one shard, let `edit` change its tensors in place, save it back; returns the shard."""
    from safetensors.torch import load_file, save_file

    (shard,) = directory.glob("*.safetensors")
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return shard


def rewrite_config(directory: Path, changes: dict[str, Any], remove: tuple[str, ...] = ()) -> Path:
    """Change (and drop) config.json fields of an HF directory; returns config.json's path."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    for key in remove:
        config.pop(key)
    path.write_text(json.dumps(config))
    return path


def write_gguf_model(
    path: Path,
    tensor_type: str = "F32",
    arch: str = "llama",
    vocab_size: int = 256,
    tensor_shapes: dict[str, tuple[int, ...] | None] | None = None,
    metadata: dict[str, Any] | None = None,
    hidden_size: int = 64,
) -> None:
    """A tiny random llama GGUF with every weight matrix stored as `tensor_type` (norms stay F32); `hidden_size`
    256 (and the MLP twice that) for the types in blocks of 256 values (K-quants, IQ4_XS).

    `tensor_shapes` changes a tensor's shape, adds a tensor (a new name) or drops one (None); `metadata` changes or
    adds `{arch}.*` keys (int -> uint32, float -> float32, str -> string). Both exist to write malformed files.
    """
    from gguf import GGMLQuantizationType, GGUFWriter

    rng = np.random.default_rng(0)
    h, inter, layers, heads, kv = hidden_size, 2 * hidden_size, 2, 4, 2
    w = GGUFWriter(str(path), arch)
    settings: dict[str, Any] = {
        "block_count": layers,
        "context_length": 512,
        "embedding_length": h,
        "feed_forward_length": inter,
        "attention.head_count": heads,
        "attention.head_count_kv": kv,
        "rope.freq_base": 10000.0,
        "attention.layer_norm_rms_epsilon": 1e-5,
        "vocab_size": vocab_size,
    }
    for key, value in {**settings, **(metadata or {})}.items():
        if isinstance(value, str):
            w.add_string(f"{arch}.{key}", value)
        elif isinstance(value, float):
            w.add_float32(f"{arch}.{key}", value)
        else:
            w.add_uint32(f"{arch}.{key}", value)
    add_toy_gguf_tokenizer(w, vocab_size)
    qtype = GGMLQuantizationType[tensor_type]

    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab_size, h)}
    for i in range(layers):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (h,),
            f"blk.{i}.ffn_norm.weight": (h,),
            f"blk.{i}.attn_q.weight": (h, h),
            f"blk.{i}.attn_k.weight": (kv * h // heads, h),
            f"blk.{i}.attn_v.weight": (kv * h // heads, h),
            f"blk.{i}.attn_output.weight": (h, h),
            f"blk.{i}.ffn_gate.weight": (inter, h),
            f"blk.{i}.ffn_up.weight": (inter, h),
            f"blk.{i}.ffn_down.weight": (h, inter),
        }
    shapes["output_norm.weight"] = (h,)
    for name, shape in {**shapes, **(tensor_shapes or {})}.items():
        if shape is None:
            continue
        data = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        add_gguf_tensor(w, name, data, GGMLQuantizationType.F32 if len(shape) == 1 else qtype, rng)  # norms: F32
    write_gguf_file(w)


def add_toy_gguf_tokenizer(w: Any, vocab_size: int) -> None:
    """A GGUF writer's toy gpt2 tokenizer: tokens t0.., then <s> and </s> (the eos), as control tokens."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([f"t{i}" for i in range(vocab_size - 2)] + ["<s>", "</s>"])
    w.add_token_merges([])
    w.add_token_types([1] * (vocab_size - 2) + [3, 3])
    w.add_eos_token_id(vocab_size - 1)


# byte offsets of the fp16 scales in one block, for the types gguf-py dequantizes but cannot quantize (IQ1_M's
# scale is spread over four nibbles: `_iq1_m_scale` sets it)
RANDOM_BLOCK_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "IQ4_NL": (0,), "IQ4_XS": (0,), "IQ1_M": ()}
RANDOM_BLOCK_SCALES |= {t: (0,) for t in ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S")}


def _iq1_m_scale(blocks: np.ndarray) -> None:
    """IQ1_M's fp16 super-block scale is the top nibbles of its four uint16 sub-scales (bytes 48-55): set it to
    2^-8 (0x1C00), nibbles 0, 0, 0xC, 0x1 from the lowest."""
    for byte, nibble in zip((49, 51, 53, 55), (0x0, 0x0, 0xC, 0x1), strict=True):
        blocks[:, byte] = (blocks[:, byte] & 0x0F) | (nibble << 4)


def add_gguf_tensor(w: Any, name: str, data: np.ndarray, qtype: Any, rng: np.random.Generator | None = None) -> None:
    """Add float32 `data` to a GGUF writer stored as `qtype` (F32, F16, F64 or a block type it quantizes to); for
    the block types of RANDOM_BLOCK_SCALES, random codes of `data`'s shape with small fp16 scales instead."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    if qtype == GGMLQuantizationType.F32:
        w.add_tensor(name, data)
    elif qtype in (GGMLQuantizationType.F16, GGMLQuantizationType.F64):
        w.add_tensor(name, data.astype(np.float16 if qtype == GGMLQuantizationType.F16 else np.float64))
    elif qtype.name in RANDOM_BLOCK_SCALES:
        rng = rng or np.random.default_rng(0)
        per_block, size = GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, (data.size // per_block, size), dtype=np.uint8)
        for at in RANDOM_BLOCK_SCALES[qtype.name]:
            scales = rng.uniform(1e-4, 1e-2, (len(blocks), 1)).astype(np.float16)
            blocks[:, at : at + 2] = scales.view(np.uint8)
        if qtype.name == "IQ1_M":
            _iq1_m_scale(blocks)
        w.add_tensor(name, blocks.reshape(data.shape[0], -1), raw_dtype=qtype)
    else:
        w.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)


def write_gguf_file(w: Any) -> None:
    """Write a GGUF writer's header, metadata and tensors, and close it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
