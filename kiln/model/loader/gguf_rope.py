"""Rope scaling in GGUF files, read into `ModelConfig.rope_scaling`: linear (metadata), llama 3.1's `rope_freqs`
tensor, and Phi-3's long-rope.

llama.cpp's converter (convert_hf_to_gguf.py, Phi3MiniModel) writes Phi-3's long-rope as HF's `long_factor` and
`short_factor` unchanged, as the F32 tensors `rope_factors_long.weight` and `rope_factors_short.weight`, with
`{arch}.context_length` (HF's max_position_embeddings), `{arch}.rope.scaling.original_context_length` (HF's
original_max_position_embeddings) and `{arch}.rope.scaling.attn_factor` (HF's attention factor, which it computes
as HF does). kiln reads them into the fields `kiln.model.loader.hf_rope` fills for an HF Phi-3 longrope config.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, ReaderTensor
from gguf.quants import dequantize

from kiln.errors import ModelLoadError
from kiln.model.loader.base import ConfigFields, longrope_scaling
from kiln.model.loader.gguf_names import ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT, ROPE_FREQS

LONG_ROPE_NAMES = (ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT)


def read_rope_scaling(
    fields: ConfigFields,
    arch: str,
    tensors: dict[str, ReaderTensor],
    head_dim: int,
    longest: int,
    long_rope: bool,
) -> dict | None:
    """The rope scaling of a file of llama.cpp architecture `arch` holding `tensors` (name -> tensor); `longest` is
    its context length, `long_rope` whether its family reads Phi-3's factor tensors (else they stay unknown
    tensors, refused when the weights are checked)."""
    found = [name for name in LONG_ROPE_NAMES if long_rope and name in tensors]
    if ROPE_FREQS in tensors:  # llama 3.1-style scaling baked into per-frequency factors
        if found:
            raise ModelLoadError(fields.path, f"holds both {ROPE_FREQS} and {found[0]}: expected one kind of factors")
        return {"rope_type": "freq_factors"}
    key = f"{arch}.rope.scaling.type"
    scaling_type = fields.lookup(key)
    kinds = ("none", "linear", "longrope") if long_rope else ("none", "linear")
    if scaling_type not in (None, *kinds):
        raise fields.error(key, f"is {scaling_type!r}; kiln runs {', '.join(kinds)} (or {ROPE_FREQS}) for {arch}")
    if found or scaling_type == "longrope":
        return _long_rope(fields, arch, tensors=tensors, head_dim=head_dim, longest=longest)
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": fields.positive_float(f"{arch}.rope.scaling.factor", 1.0)}
    return None


def _long_rope(fields: ConfigFields, arch: str, tensors: dict[str, ReaderTensor], head_dim: int, longest: int) -> dict:
    missing = [name for name in LONG_ROPE_NAMES if name not in tensors]
    if missing:
        raise ModelLoadError(
            fields.path,
            f"has no tensor {missing[0]}: Phi-3's long-rope needs both {' and '.join(LONG_ROPE_NAMES)} "
            f"(head_dim / 2 = {head_dim // 2} factors each)",
        )
    original = fields.positive_int(f"{arch}.rope.scaling.original_context_length")
    attention_key = f"{arch}.rope.scaling.attn_factor"
    attention = None if fields.lookup(attention_key) is None else fields.positive_float(attention_key)
    short = rope_factors(fields.path, tensors[ROPE_FACTORS_SHORT], head_dim)
    long = rope_factors(fields.path, tensors[ROPE_FACTORS_LONG], head_dim)
    return longrope_scaling(original, longest, short.tolist(), long.tolist(), attention_factor=attention)


FACTOR_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def rope_factors(path: str, t: ReaderTensor, head_dim: int) -> np.ndarray:
    """A tensor of per-frequency rope factors (rope_freqs, rope_factors_*) as float32: head_dim / 2 positive values."""
    expected = (head_dim // 2,)
    shape = tuple(int(x) for x in reversed(t.shape))
    if shape != expected:
        raise ModelLoadError(
            path, f"tensor {t.name} has shape {shape}, expected {expected} (one factor per rotary frequency)"
        )
    if t.tensor_type not in FACTOR_TYPES:  # llama.cpp's converter writes 1-D tensors unquantized
        raise ModelLoadError(path, f"tensor {t.name} is stored as {t.tensor_type.name}, expected F32, F16 or BF16")
    values = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(expected)
    if not (np.isfinite(values).all() and (values > 0).all()):
        raise ModelLoadError(path, f"tensor {t.name} must hold positive factors, found {values.tolist()!r:.80}")
    return values
