"""How the paged KV cache holds keys and values: the KV cache dtypes (vLLM's names, `--kv-cache-dtype`).

Each token's key (and value) of one KV head is a row of the cache's last dimension:

| name      | the cache's torch dtype | a row                                                                 |
|-----------|-------------------------|-----------------------------------------------------------------------|
| float32   | float32                 | head_dim values                                                       |
| bfloat16  | bfloat16                | head_dim values, rounded to bfloat16                                  |
| float16   | float16                 | head_dim values, rounded to float16                                   |
| int8      | int8                    | head_dim codes round(x / s) in [-127, 127], then s (float32, 4 bytes) |
| fp8_e4m3  | uint8                   | head_dim float8_e4m3fn codes of x / s (within +-448), then s          |

with s = max|x| / 127 (int8) or / 448 (fp8) over the row: one scale per token and head, computed as the row is
written; a row reads back as codes * s. Why per token and head rather than one scale per layer: nothing to
calibrate (a per-layer scale needs a pass over data, or vLLM's 1.0, where fp8 then spends its exponent range on
nothing and int8 cannot work at all), and an outlier token costs no other token precision. The scale rides in the
row, after the codes, so one tensor still holds a layer's cache: a block carries its own scales (the prefix cache
shares blocks whole), every reader takes one tensor (the op, the decode graph, the native kernel), and the cost is
4 bytes per head_dim codes (6 % at head_dim 64). head_dim must be a multiple of 4 (the scale's alignment).

fp8 codes are held in a uint8 tensor: inductor (torch 2.13) miscompiles a write through a byte view of a float8
tensor (the values are converted, not their bits copied), so the cache never is one; the codes are viewed as
float8_e4m3fn only when read. Writes of every dtype go through `store`, reads through `unpack_rows`.
"""

from __future__ import annotations

import torch

from kiln.config import AUTO_KV_CACHE_DTYPE, KV_CACHE_DTYPE_NAMES, KV_SCALE_BYTES
from kiln.errors import ConfigError

FP8 = torch.float8_e4m3fn
# the cache's torch dtype of each name ("auto" is resolved by `kv_storage_dtype`)
STORAGE = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
    "fp8_e4m3": torch.uint8,
}
NAMES = {dtype: name for name, dtype in STORAGE.items()}
# the largest code of a scaled dtype: s = max|x| / QMAX
QMAX = {torch.int8: 127.0, torch.uint8: 448.0}


def kv_storage_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype for the KV cache dtype `name` of a model computing in `model_dtype`; "auto" is
    AUTO_KV_CACHE_DTYPE for a float32 model, else the model's own dtype (never wider than the model computes)."""
    if name == "auto":
        return STORAGE[AUTO_KV_CACHE_DTYPE] if model_dtype == torch.float32 else model_dtype
    if name not in STORAGE:
        raise ConfigError(f"unknown KV cache dtype {name!r}: expected one of {', '.join(KV_CACHE_DTYPE_NAMES)}")
    return STORAGE[name]


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The KV cache dtype a cache of torch dtype `dtype` holds (its vLLM name; the debugger's float64 reference
    engine keeps its model's dtype under torch's name)."""
    return NAMES.get(dtype, str(dtype).removeprefix("torch."))


def is_scaled(dtype: torch.dtype) -> bool:
    """Whether rows of a cache of torch dtype `dtype` carry a scale after their codes (int8, fp8_e4m3)."""
    return dtype in QMAX


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one row (a token's key or value of one head) in a cache of torch dtype `dtype`."""
    return head_dim + KV_SCALE_BYTES if is_scaled(dtype) else head_dim


def cache_head_dim(kv_cache: torch.Tensor) -> int:
    """The head dim of a cache laid out by kiln.model.attention.kv_cache_shape (its rows less their scale)."""
    return kv_cache.shape[-1] - (KV_SCALE_BYTES if is_scaled(kv_cache.dtype) else 0)


def pack_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., head_dim] -> its rows [..., row_width] as a cache of torch dtype `dtype` stores them."""
    if not is_scaled(dtype):
        return x.to(dtype)
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / QMAX[dtype]).clamp_min(torch.finfo(torch.float32).tiny)
    y = xf / scale
    if dtype == torch.int8:
        codes = torch.round(y).clamp(-127, 127).to(torch.int8)
    else:
        codes = y.clamp(-448, 448).to(FP8).view(torch.uint8)
    return torch.cat((codes, scale.view(dtype)), -1)


def unpack_rows(rows: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Stored rows [..., row_width] (of a cache's torch dtype) -> their values [..., head_dim] in `out_dtype`."""
    if not is_scaled(rows.dtype):
        return rows.to(out_dtype)
    head_dim = rows.shape[-1] - KV_SCALE_BYTES
    codes = rows[..., :head_dim]
    if rows.dtype == torch.uint8:
        codes = codes.view(FP8)
    return (codes.float() * rows[..., head_dim:].view(torch.float32)).to(out_dtype)


def store(kv_cache: torch.Tensor, new: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Write `new` [2, kv_heads, n, head_dim] (keys, values) at the flat `slots` [n] of `kv_cache` (laid out by
    kiln.model.attention.kv_cache_shape); returns the rows written [2, kv_heads, n, row_width]."""
    _, num_kv_heads, _, _, width = kv_cache.shape
    rows = pack_rows(new, kv_cache.dtype)
    kv_cache.view(2, num_kv_heads, -1, width).index_copy_(2, slots, rows)
    return rows
