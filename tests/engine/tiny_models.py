"""Small random checkpoints written to disk, so loaders and families are tested without any hub."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from kiln.model.loader import default_model_path

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def default_tokenizer_json() -> str:
    """The default model's tokenizer as tokenizer.json text (vocab 49152)."""
    from kiln.model.loader import GGUFCheckpoint
    from kiln.model.tokenizer import KilnTokenizer

    return KilnTokenizer.from_gguf(GGUFCheckpoint(default_model_path())).tokenizer.to_str()


def write_hf_model(directory: Path, family: str, vocab_size: int = 256, **overrides) -> torch.nn.Module:
    """Save a tiny random HF transformers model (llama | qwen2 | mistral) with a tokenizer; returns the HF model."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }
    config_cls, model_cls = classes[family]
    torch.manual_seed(0)
    config = config_cls(vocab_size=vocab_size, max_position_embeddings=512, **{**TINY, **overrides})
    model = model_cls(config).eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tok = json.loads(default_tokenizer_json())
    (directory / "tokenizer.json").write_text(json.dumps(tok))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": None}))
    return model


def write_gguf_model(path: Path, tensor_type: str = "F32", arch: str = "llama", vocab_size: int = 256) -> None:
    """A tiny random llama GGUF with every weight matrix stored as `tensor_type` (norms stay F32)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    h, inter, layers, heads, kv = 64, 128, 2, 4, 2
    w = GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(h)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([f"t{i}" for i in range(vocab_size - 2)] + ["<s>", "</s>"])
    w.add_token_merges([])
    w.add_token_types([1] * (vocab_size - 2) + [3, 3])
    w.add_eos_token_id(vocab_size - 1)
    qtype = GGMLQuantizationType[tensor_type]

    def add(name: str, shape: tuple[int, ...], quantized: bool = True) -> None:
        data = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        if not quantized or qtype == GGMLQuantizationType.F32:
            w.add_tensor(name, data)
        elif qtype == GGMLQuantizationType.F16:
            w.add_tensor(name, data.astype(np.float16))
        else:
            w.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)

    add("token_embd.weight", (vocab_size, h))
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", (h,), quantized=False)
        add(f"blk.{i}.ffn_norm.weight", (h,), quantized=False)
        add(f"blk.{i}.attn_q.weight", (h, h))
        add(f"blk.{i}.attn_k.weight", (kv * h // heads, h))
        add(f"blk.{i}.attn_v.weight", (kv * h // heads, h))
        add(f"blk.{i}.attn_output.weight", (h, h))
        add(f"blk.{i}.ffn_gate.weight", (inter, h))
        add(f"blk.{i}.ffn_up.weight", (inter, h))
        add(f"blk.{i}.ffn_down.weight", (h, inter))
    add("output_norm.weight", (h,), quantized=False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
