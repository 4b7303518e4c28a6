"""GGUF's block-quantized types as kiln's packed form: per group of 32 weights along the input dimension,
`w = code * scale + offset`, with int8 codes and float32 scale and offset.

- Q8_0 (34 bytes: fp16 d, 32 int8 q): w = q * d, so code = q, scale = d, offset = 0.
- Q4_0 (18 bytes: fp16 d, 16 bytes of nibbles): w = (q - 8) * d, so code = q - 8, scale = d, offset = 0.
- Q4_1 (20 bytes: fp16 d, fp16 m, 16 bytes of nibbles): w = q * d + m, so code = q - 8, scale = d,
  offset = m + 8 d. The sum m + 8 d of two fp16 values is exact in float32, so code * scale + offset rounds once,
  from the same real value as ggml's q * d + m: the dequantized weights are bit-identical.
In a nibble block the low nibbles hold the group's first 16 weights and the high nibbles the last 16.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

GROUP = 32
PACKED_TYPES = {
    GGMLQuantizationType.Q8_0: 34,
    GGMLQuantizationType.Q4_0: 18,
    GGMLQuantizationType.Q4_1: 20,
}


def decode_blocks(raw: np.ndarray, kind: GGMLQuantizationType, rows: int, cols: int) -> tuple[np.ndarray, ...]:
    """(codes int8 [rows, cols/32, 32], scale float32 [rows, cols/32, 1], offset float32 [rows, cols/32, 1])
    of a [rows, cols] weight stored as `kind` blocks (raw bytes, any shape with rows * cols/32 blocks)."""
    size = PACKED_TYPES[kind]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, cols // GROUP, size)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # [rows, groups, 1]
    if kind == GGMLQuantizationType.Q8_0:
        codes = blocks[..., 2:].copy().view(np.int8)
        return codes, d, np.zeros_like(d)
    start = 2 if kind == GGMLQuantizationType.Q4_0 else 4
    nibbles = blocks[..., start:]
    codes = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=-1).astype(np.int8) - 8
    if kind == GGMLQuantizationType.Q4_0:
        return codes, d, np.zeros_like(d)
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    return codes, d, m + 8 * d
