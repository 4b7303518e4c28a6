"""GGUF checkpoints: header, dequantized weights (via the `gguf` package) and tokenizer metadata.

Construction checks that every tensor's data lies inside the file; the config is read by the one config reader
through a `GGUFConfigView` (the metadata under config.json's names); tensor types and names are checked before any
weight is dequantized.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cached_property
from typing import Any

import numpy as np
import torch
from gguf import ReaderTensor
from gguf.quants import dequantize

from kiln.config import ModelConfig
from kiln.errors import ModelLoadError
from kiln.model.loader.base import CheckpointHeader
from kiln.model.loader.config_reader import read_model_config
from kiln.model.loader.config_view import GGUFConfigView
from kiln.model.loader.families import Family, gguf_architectures, gguf_family
from kiln.model.loader.gguf_layout import GGUFLayout, HFTensor, gguf_name, hf_tensors, known_names
from kiln.model.loader.gguf_names import ROPE_FREQS
from kiln.model.loader.gguf_reader import read_header
from kiln.model.loader.gguf_rope import rope_factors
from kiln.quant.gguf_blocks import PACKED_TYPES, decode_blocks, layout_of
from kiln.quant.linear import PackedTensor

# read packed (kiln.quant.gguf_blocks.PACKED_TYPES) or dequantized to float; with --quantization packed, the
# quantized types outside PACKED_TYPES load dequantized (and the log says so)
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
SUPPORTED_TYPES += ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS")
# i-quants (codebook lattices: dequantized at load by gguf-py, no packed kiln form), ternary and MXFP4 (packed)
SUPPORTED_TYPES += ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0", "MXFP4")
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def _unpermute_rope(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary pairs -> HF's rotate-half layout)."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFCheckpoint:
    """One GGUF file. Construction reads only the header; `weights()` dequantizes lazily, one tensor at a time."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self.reader = read_header(path)
        except (ValueError, IndexError, OSError, KeyError) as exc:
            raise ModelLoadError(path, f"not a readable GGUF file: cut short or corrupt ({exc})") from None

    def field(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        if f is None:
            return default
        return f.contents()

    @cached_property
    def _found(self) -> tuple[Family, GGUFLayout]:
        arch = self.field("general.architecture")
        found = gguf_family(arch, bool(self.field(f"{arch}.expert_count"))) if isinstance(arch, str) else None
        if found is None:
            raise ModelLoadError(
                self.path, f"unsupported architecture {arch!r}: kiln runs {', '.join(gguf_architectures())}"
            )
        return found

    @property
    def kiln_family(self) -> Family:
        """The family of the file's `general.architecture` (with experts or not: llama.cpp's Mixtral is "llama")."""
        return self._found[0]

    @property
    def family(self) -> GGUFLayout:
        """How the file is laid out: its family's `gguf` layout."""
        return self._found[1]

    @cached_property
    def architecture(self) -> str:
        """llama.cpp's name of the file's architecture (`general.architecture`)."""
        return self.family.architecture

    @cached_property
    def _hf_tensors(self) -> dict[str, list[HFTensor]]:
        """GGUF tensor name -> the HF tensors it loads as ([] for none)."""
        return {t.name: hf_tensors(self.family, t.name, _shape(t)) for t in self.reader.tensors}

    @cached_property
    def tensor_types(self) -> dict[str, str]:
        return {t.name: t.tensor_type.name for t in self.reader.tensors}

    def _check_types(self) -> None:
        bad = [(n, ty) for n, ty in self.tensor_types.items() if ty not in SUPPORTED_TYPES]
        if bad:
            (name, ty), more = bad[0], f" and {len(bad) - 1} more" if len(bad) > 1 else ""
            raise ModelLoadError(
                self.path,
                f"unsupported tensor type {ty} (tensor {name}{more}); kiln reads {', '.join(SUPPORTED_TYPES)}",
            )

    def _check_names(self) -> None:
        rope = self.family.rope_tensors()
        unknown = [name for name, hf in self._hf_tensors.items() if name not in rope and not hf]
        if unknown:
            more = f" and {len(unknown) - 1} more" if len(unknown) > 1 else ""
            raise ModelLoadError(
                self.path,
                f"unknown tensor {unknown[0]}{more}: kiln reads {self.architecture} files' "
                f"{', '.join(known_names(self.family))} and {', '.join(rope)}",
            )

    @cached_property
    def config(self) -> ModelConfig:
        view = GGUFConfigView(
            self.path,
            self.architecture,
            field=self.field,
            tensors={t.name: t for t in self.reader.tensors},
            layout=self.family,
            num_tokens=self._vocab_from_tokens(),
        )
        return read_model_config(view, self.kiln_family)

    def _vocab_from_tokens(self) -> int | None:
        """The token list's length: the vocabulary size when `{arch}.vocab_size` is absent."""
        tokens = self.reader.fields.get("tokenizer.ggml.tokens")
        return None if tokens is None else len(tokens.data)

    def header(self) -> CheckpointHeader:
        return CheckpointHeader(
            path=self.path,
            format="gguf",
            config=self.config,
            tensor_types=dict(self.tensor_types),
            tensor_shapes={t.name: _shape(t) for t in self.reader.tensors},
        )

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name -> shape of every tensor `weights()` yields, from the header (after the same type and name
        checks as `weights()`)."""
        self._check_types()
        self._check_names()
        return {hf.name: hf.shape for tensors in self._hf_tensors.values() for hf in tensors}

    def file_of(self, name: str) -> str:
        return self.path

    def tensor_label(self, name: str) -> str:
        """How messages name an HF-named tensor: by its name in this file (in the family's naming if it has none)."""
        return self._labels.get(name) or gguf_name(self.family, name)

    @cached_property
    def _labels(self) -> dict[str, str]:
        return {
            hf.name: name if hf.expert is None else f"{name} (expert {hf.expert})"
            for name, tensors in self._hf_tensors.items()
            for hf in tensors
        }

    def rope_freq_factors(self) -> torch.Tensor | None:
        """The rope_freqs tensor (one factor per rotary frequency), or None when the file has none."""
        t = next((t for t in self.reader.tensors if t.name == ROPE_FREQS), None)
        if t is None:
            return None
        self._check_types()
        return torch.from_numpy(rope_factors(self.path, t, self.config.head_dim))

    def packed_layout(self, hf_name: str) -> tuple[int, int] | None:
        """(bits per code, group size) when `weights(packed=True)` yields this tensor packed (a 2-D weight in one
        of kiln.quant's PACKED_TYPES), else None."""
        t = self._tensors_by_hf_name.get(hf_name)
        if t is None or t.tensor_type not in PACKED_TYPES or len(t.shape) != 2:
            return None
        return layout_of(t.tensor_type)

    def dequantized_types(self) -> dict[str, int]:
        """Quantized types this file holds that kiln cannot keep packed (they load dequantized): type -> count."""
        counts: dict[str, int] = {}
        for t in self.reader.tensors:
            if t.tensor_type.name not in FLOAT_TYPES and t.tensor_type not in PACKED_TYPES:  # IQ4_NL too
                counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        return counts

    @cached_property
    def _tensors_by_hf_name(self) -> dict[str, ReaderTensor]:
        by_name = {t.name: t for t in self.reader.tensors}
        return {hf.name: by_name[n] for n, tensors in self._hf_tensors.items() for hf in tensors if hf.expert is None}

    def weights(self, packed: bool = False) -> Iterator[tuple[str, torch.Tensor | PackedTensor]]:
        """Yield (HF name, float32 tensor) pairs, dequantized one at a time; with `packed`, weights in
        kiln.quant's PACKED_TYPES come as PackedTensor instead, bit-identical once dequantized."""
        self._check_types()
        self._check_names()
        for t in self.reader.tensors:
            targets = self._hf_tensors[t.name]
            if packed and len(targets) == 1 and self.packed_layout(targets[0].name) is not None:
                yield targets[0].name, self._packed(t)
                continue
            if not targets:
                continue
            array = self._dequantized(t)
            for hf in targets:
                part = (array if hf.expert is None else array[hf.expert]).reshape(hf.shape)  # expert: one of a stack
                if not part.flags.writeable or not part.flags.c_contiguous:
                    part = np.array(part, copy=True, order="C")
                yield hf.name, torch.from_numpy(part)

    def _dequantized(self, t: ReaderTensor) -> np.ndarray:
        """Tensor `t` as float32 with the family's value transforms undone (q/k row order, Gemma's 1 + w norms)."""
        try:
            # NOTE: over a plain array: gguf splits the data in row groups, and each slice of a memmap costs a
            # memmap's bookkeeping (2.1 -> 1.35 s for the default model's weights)
            array = dequantize(t.data.view(np.ndarray), t.tensor_type)
        except (ValueError, TypeError) as exc:
            raise ModelLoadError(self.path, f"cannot dequantize tensor {t.name} ({exc})") from None
        array = np.asarray(array, dtype=np.float32).reshape(_shape(t))
        num_heads = self._permuted_heads(t.name)
        if num_heads is not None:
            array = self._unpermute(t.name, array, num_heads)
        if self.family.norm_plus_one and t.name.endswith("norm.weight"):
            array = array - 1.0  # NOTE: what transformers' Gemma2TensorProcessor does to every *norm.weight
        return array

    def _permuted_heads(self, name: str) -> int | None:
        """The heads whose rows llama.cpp interleaved in tensor `name`, or None when it did not permute it."""
        if not self.family.permuted_qk:
            return None
        if name.endswith(("attn_q.weight", "attn_q.bias")):
            return self.config.num_heads
        if name.endswith(("attn_k.weight", "attn_k.bias")):
            return self.config.num_kv_heads
        return None

    def _packed(self, t: ReaderTensor) -> PackedTensor:
        rows, cols = _shape(t)
        parts = decode_blocks(t.data, t.tensor_type, rows, cols)
        num_heads = self._permuted_heads(t.name)
        if num_heads is not None:  # the rows permute as they do dequantized: codes, scale and offset alike
            parts = tuple(self._unpermute(t.name, a, num_heads) for a in parts)
        bits, _ = layout_of(t.tensor_type)
        return PackedTensor(*(torch.from_numpy(np.ascontiguousarray(a)) for a in parts), bits=bits)

    def _unpermute(self, name: str, array: np.ndarray, num_heads: int) -> np.ndarray:
        if array.shape[0] % (2 * num_heads):
            raise ModelLoadError(
                self.path,
                f"tensor {name} has {array.shape[0]} rows, which do not split into {num_heads} heads of rotary pairs",
            )
        return _unpermute_rope(array, num_heads)

    @property
    def num_tensors(self) -> int:
        return len(self.reader.tensors)


def _shape(t: ReaderTensor) -> tuple[int, ...]:
    """A tensor's logical shape, outermost first (GGUF stores dimensions innermost first)."""
    return tuple(int(x) for x in reversed(t.shape))
