"""GGUF's block-quantized types as kiln's packed form: per group of weights along the input dimension,
`w = code * scale + offset`, with float32 scale and offset per group.

Codes are stored as the format's bit width allows: 4-bit codes two to a byte (uint8, byte i of a group holding
code i in its low nibble and code i + group/2 in its high nibble), wider codes one int8 each.

| type | bytes per block | group | code            | scale       | offset         |
|------|-----------------|-------|-----------------|-------------|----------------|
| Q8_0 | 34 per 32       | 32    | q (int8)        | d           | 0              |
| Q4_0 | 18 per 32       | 32    | q in 0..15      | d           | -8 d           |
| Q4_1 | 20 per 32       | 32    | q in 0..15      | d           | m              |
| Q4_K | 144 per 256     | 32    | q in 0..15      | d * sc_j    | -dmin * m_j    |
| Q5_K | 176 per 256     | 32    | q in 0..31      | d * sc_j    | -dmin * m_j    |
| Q6_K | 210 per 256     | 16    | q - 32 (int8)   | d * sc_j    | 0              |
| TQ1_0 | 54 per 256     | 256   | -1, 0, 1 (int8) | d           | 0              |
| TQ2_0 | 66 per 256     | 256   | -1, 0, 1 (int8) | d           | 0              |
| MXFP4 | 17 per 32      | 32    | 2 x e2m1 (int8, -12..12) | 2^(e-128) | 0        |

Every product and sum above is exact in float32 or is the one rounding ggml itself makes, so `code * scale +
offset`, computed as a multiply and then an add, gives the weights ggml's dequantization gives, bit for bit. The
K-quants' 6-bit sub-block scales and mins (Q4_K, Q5_K) and int8 scales (Q6_K) are folded into per-group floats.
The ternary types and MXFP4 take their codes from gguf-py's own dequantization divided by the block's scale (a
power of two for MXFP4, the code's own multiplier for the ternary ones: exact).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import MXFP4, dequantize

GROUP = 32
SUPER = 256  # weights per K-quant super-block
# type -> (bytes per block, weights per block, group, bits per code)
PACKED_TYPES = {
    T.Q8_0: (34, 32, 32, 8),
    T.Q4_0: (18, 32, 32, 4),
    T.Q4_1: (20, 32, 32, 4),
    T.Q4_K: (144, SUPER, 32, 4),
    T.Q5_K: (176, SUPER, 32, 5),
    T.Q6_K: (210, SUPER, 16, 6),
    T.TQ1_0: (54, SUPER, SUPER, 2),
    T.TQ2_0: (66, SUPER, SUPER, 2),
    T.MXFP4: (17, 32, 32, 5),  # codes -12..12 need 5 bits as integers
}

Parts = tuple[np.ndarray, np.ndarray, np.ndarray]


def layout_of(kind: T) -> tuple[int, int]:
    """(bits per code, group size) of a packed type."""
    _, _, group, bits = PACKED_TYPES[kind]
    return bits, group


def decode_blocks(raw: np.ndarray, kind: T, rows: int, cols: int) -> Parts:
    """(codes, scale [rows, cols/group, 1], offset [rows, cols/group, 1]) of a [rows, cols] weight stored as
    `kind` blocks (raw bytes, any shape with the right number of blocks). Codes are uint8 [rows, cols/group,
    group/2] nibble pairs for 4-bit types and int8 [rows, cols/group, group] otherwise."""
    size, per_block, group, bits = PACKED_TYPES[kind]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows * cols // per_block, size)
    q, scale, offset = _DECODERS[kind](blocks)
    shape = (rows, cols // group, group)
    q, scale, offset = q.reshape(shape), scale.reshape(*shape[:2], 1), offset.reshape(*shape[:2], 1)
    codes = pack_nibbles(q) if bits == 4 else q.astype(np.int8)
    return codes, scale.astype(np.float32), offset.astype(np.float32)


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Codes 0..15 [..., group] -> uint8 [..., group/2]: code i low, code i + group/2 high."""
    half = q.shape[-1] // 2
    q = q.astype(np.uint8)
    return q[..., :half] | (q[..., half:] << 4)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)  # [blocks, 1]


def _low_high(packed: np.ndarray) -> np.ndarray:
    """[blocks, chunks, 32] bytes -> [blocks, chunks, 64] codes: each chunk's low nibbles, then its high nibbles."""
    return np.concatenate([packed & 0xF, packed >> 4], axis=-1)


def _q8_0(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    d = _f16(blocks, 0)
    return blocks[:, 2:].view(np.int8), d, np.zeros_like(d)


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    d = _f16(blocks, 0)
    return _low_high(blocks[:, None, 2:]), d, -8 * d


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    return _low_high(blocks[:, None, 4:]), _f16(blocks, 0), _f16(blocks, 2)


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the 8 sub-blocks' scale (d * sc) and offset (-dmin * m) from the 12 packed 6-bit bytes."""
    s = blocks[:, 4:16].reshape(-1, 3, 4)
    low, high, mixed = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([low & 0x3F, (mixed & 0xF) | ((low >> 2) & 0x30)], axis=-1).astype(np.float32)
    m = np.concatenate([high & 0x3F, (mixed >> 4) | ((high >> 2) & 0x30)], axis=-1).astype(np.float32)
    return _f16(blocks, 0) * sc, -(_f16(blocks, 2) * m)


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    scale, offset = _k_scales(blocks)
    return _low_high(blocks[:, 16:].reshape(-1, 4, 32)), scale, offset


def _q5_k(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    scale, offset = _k_scales(blocks)
    low = _low_high(blocks[:, 48:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    qh = blocks[:, 16:48]  # bit j of byte l: the fifth bit of weight l of sub-block j
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    return low | (high << 4), scale, offset


def _q6_k(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    ql = blocks[:, :128].reshape(-1, 2, 64)  # two halves of 128 weights
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32)
    low = np.concatenate([ql & 0xF, ql >> 4], axis=-1).reshape(-1, 2, 4, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & 3
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)
    sc = blocks[:, 192:208].view(np.int8).astype(np.float32)  # one int8 scale per 16 weights
    return q, _f16(blocks, 208) * sc, np.zeros_like(sc)


def _codes_over(kind: T, d: np.ndarray, blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """(codes, d, 0) of blocks whose weights gguf-py dequantizes to integer codes times d [blocks, 1]."""
    weights = np.asarray(dequantize(blocks, kind), dtype=np.float32).reshape(len(blocks), -1)
    codes = np.rint(weights / np.where(d == 0, 1, d)).astype(np.int8)
    return codes, d, np.zeros_like(d)


def _tq1_0(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    return _codes_over(T.TQ1_0, _f16(blocks, 52), blocks)


def _tq2_0(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    return _codes_over(T.TQ2_0, _f16(blocks, 64), blocks)


def _mxfp4(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    return _codes_over(T.MXFP4, MXFP4.e8m0_to_fp32_half(blocks[:, :1].copy()), blocks)


_DECODERS = {T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k}
_DECODERS |= {T.TQ1_0: _tq1_0, T.TQ2_0: _tq2_0, T.MXFP4: _mxfp4}
