"""GGUF checkpoints: header, dequantized weights (via the `gguf` package) and tokenizer metadata."""

from __future__ import annotations

import os
from collections.abc import Iterator
from functools import cached_property

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from kiln.config import ModelConfig
from kiln.errors import ModelLoadError
from kiln.model.loader.base import CheckpointHeader

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
SUPPORTED_ARCHS = ("llama", "qwen2", "mistral")

# GGUF tensor name (after `blk.N.`) -> HF parameter name (after `model.layers.N.`)
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def gguf_to_hf_name(name: str) -> str | None:
    """HF parameter name of a GGUF tensor, or None for tensors kiln derives itself (rope_freqs)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    if name.startswith("blk."):
        _, idx, rest = name.split(".", 2)
        if rest in _LAYER_NAMES:
            return f"model.layers.{idx}.{_LAYER_NAMES[rest]}"
    return None


def _unpermute_rope(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary pairs -> HF's rotate-half layout)."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFCheckpoint:
    """One GGUF file. Construction reads only the header; `weights()` dequantizes lazily, one tensor at a time."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self.reader = GGUFReader(path)
        except (ValueError, IndexError, OSError, KeyError) as exc:
            raise ModelLoadError(path, f"not a readable GGUF file ({exc})") from None
        self._check_complete()

    def _check_complete(self) -> None:
        size = os.path.getsize(self.path)
        for t in self.reader.tensors:
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size:
                raise ModelLoadError(
                    self.path,
                    f"truncated: tensor {t.name} ends at byte {end} but the file has {size} bytes",
                )

    def field(self, key: str, default=None):
        f = self.reader.fields.get(key)
        if f is None:
            return default
        return f.contents()

    @cached_property
    def architecture(self) -> str:
        arch = self.field("general.architecture")
        if arch not in SUPPORTED_ARCHS:
            raise ModelLoadError(
                self.path, f"unsupported architecture {arch!r}: kiln runs {', '.join(SUPPORTED_ARCHS)}"
            )
        return arch

    @cached_property
    def tensor_types(self) -> dict[str, str]:
        return {t.name: t.tensor_type.name for t in self.reader.tensors}

    def _check_types(self) -> None:
        bad = {n: ty for n, ty in self.tensor_types.items() if ty not in SUPPORTED_TYPES}
        if bad:
            name, ty = next(iter(bad.items()))
            raise ModelLoadError(
                self.path,
                f"unsupported quantization type {ty} (tensor {name} and {len(bad) - 1} more); "
                f"kiln dequantizes {', '.join(SUPPORTED_TYPES)}",
            )

    @cached_property
    def config(self) -> ModelConfig:
        a = self.architecture
        tensors = {t.name for t in self.reader.tensors}

        def need(key: str):
            value = self.field(f"{a}.{key}")
            if value is None:
                raise ModelLoadError(self.path, f"GGUF metadata key {a}.{key} is missing")
            return value

        hidden = int(need("embedding_length"))
        num_heads = int(need("attention.head_count"))
        vocab = self.field(f"{a}.vocab_size")
        if vocab is None:
            vocab = len(self.reader.fields["tokenizer.ggml.tokens"].data)
        eos = self.field("tokenizer.ggml.eos_token_id")
        rope_scaling = None
        scaling_type = self.field(f"{a}.rope.scaling.type")
        if scaling_type == "linear":
            rope_scaling = {"rope_type": "linear", "factor": float(self.field(f"{a}.rope.scaling.factor", 1.0))}
        elif scaling_type not in (None, "none"):
            raise ModelLoadError(
                self.path, f"unsupported rope scaling type {scaling_type!r} (kiln runs linear, llama3)"
            )
        if "rope_freqs.weight" in tensors:  # llama 3.1-style scaling baked into per-frequency factors
            rope_scaling = {"rope_type": "freq_factors"}
        return ModelConfig(
            architecture=a,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(need("feed_forward_length")),
            num_layers=int(need("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(self.field(f"{a}.attention.head_count_kv", num_heads)),
            head_dim=int(self.field(f"{a}.attention.key_length", hidden // num_heads)),
            rms_norm_eps=float(self.field(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(self.field(f"{a}.rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(self.field(f"{a}.context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors,
            bos_token_id=self.field("tokenizer.ggml.bos_token_id"),
            eos_token_ids=(int(eos),) if eos is not None else (),
            name=str(self.field("general.name", os.path.basename(self.path))),
        )

    def header(self) -> CheckpointHeader:
        return CheckpointHeader(
            path=self.path,
            format="gguf",
            config=self.config,
            tensor_types=dict(self.tensor_types),
            tensor_shapes={t.name: tuple(int(x) for x in reversed(t.shape)) for t in self.reader.tensors},
        )

    def rope_freq_factors(self) -> torch.Tensor | None:
        for t in self.reader.tensors:
            if t.name == "rope_freqs.weight":
                return torch.from_numpy(np.array(t.data, dtype=np.float32))
        return None

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, float32 tensor) pairs, dequantized one at a time."""
        self._check_types()
        cfg = self.config
        for t in self.reader.tensors:
            name = gguf_to_hf_name(t.name)
            if name is None:
                continue
            try:
                array = dequantize(t.data, t.tensor_type)
            except (ValueError, TypeError) as exc:
                raise ModelLoadError(self.path, f"cannot dequantize tensor {t.name} ({exc})") from None
            array = np.asarray(array, dtype=np.float32).reshape(tuple(int(x) for x in reversed(t.shape)))
            if t.name.endswith(("attn_q.weight", "attn_q.bias")):
                array = _unpermute_rope(array, cfg.num_heads)
            elif t.name.endswith(("attn_k.weight", "attn_k.bias")):
                array = _unpermute_rope(array, cfg.num_kv_heads)
            if not array.flags.writeable or not array.flags.c_contiguous:
                array = np.array(array, copy=True, order="C")
            yield name, torch.from_numpy(array)

    @property
    def num_tensors(self) -> int:
        return len(self.reader.tensors)
