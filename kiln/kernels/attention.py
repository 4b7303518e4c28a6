"""Decode attention's kernel: the traced torch form or kiln's native paged kernel, timed on this machine.

The native kernel (kiln/kernels/native/paged_attention.cpp) reads each sequence's keys and values where they lie in
the paged cache; the torch form gathers the blocks of every sequence, padded to the longest, and multiplies them.
`choose_decode_attention` times both over the engine's own cache geometry (heads, KV heads, head dim, block size,
KV dtype) at a few batch shapes, once per machine (kiln.kernels.choices), and the plan hands the winner to the step's
forward context (`ForwardContext.decode_kernel`, a `DecodeKernel`): the paged-attention op calls it at run time, a
full decode graph at trace time, so the native kernel is one node in the graph (the tier's C++ op).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from kiln.kernels.choices import KernelChoiceCache
from kiln.kernels.native.build import TIER_NAMES, native_op, runnable_tiers, source_hash, tier_by_name
from kiln.model.forward_context import DecodeKernel
from kiln.model.kv_format import cache_head_dim, kv_dtype_name, pack_rows

TORCH = "torch"
NATIVE_PREFIX = "native-"
# every KV cache dtype (kiln.model.kv_format): int8 and fp8_e4m3 (held as uint8) with their scales
NATIVE_KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8)
# (sequences, tokens each) timed for the choice: one long sequence, a small batch, a large one
TIMED_SHAPES = ((1, 1024), (8, 256), (32, 256))


class NativeDecode:
    """The native tier `tier`'s decode attention: q [n, heads * head_dim] -> [n, heads * head_dim], row i over the
    first seq_lens[i] keys of its blocks (`block_table[i]`), as kiln.model.graph_attention's traced form. Called the
    same way at run time and in a traced graph, where the C++ op is one node (its fake is registered here): no
    Python custom op's dispatch in between (~0.1 ms a call, 30 layers a step)."""

    def __init__(self, tier: str) -> None:
        self.tier = tier
        self.op = _graph_op(tier) if tier in TIER_NAMES else None

    def __call__(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        window: int,
        softcap: float,
    ) -> torch.Tensor:
        if self.op is None:
            raise RuntimeError(f"the native {self.tier} tier is not loaded here, but the kernel plan chose it")
        head_dim = cache_head_dim(kv_cache)
        out = self.op(q.float().view(q.shape[0], -1, head_dim), kv_cache, block_table, seq_lens, window, softcap)
        return out.to(q.dtype)


@functools.cache
def _graph_op(tier: str) -> Callable[..., torch.Tensor] | None:
    """The tier's C++ op, with the fake (shape-only) form a traced graph needs; None where it is not loaded."""
    op = native_op(tier, "paged_decode_attention")
    if op is not None:

        def fake(q, kv_cache, block_table, seq_lens, window, softcap):
            return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])

        torch.library.register_fake(f"{tier_by_name(tier).namespace}::paged_decode_attention", fake)
    return op


def native_tier(kernel: str) -> str | None:
    """The native tier a decode-attention kernel name runs on (None: the torch form)."""
    return kernel.removeprefix(NATIVE_PREFIX) if kernel.startswith(NATIVE_PREFIX) else None


@functools.cache
def decode_kernel(name: str) -> DecodeKernel | None:
    """The kernel a plan's decode-attention name runs (None: the torch form)."""
    tier = native_tier(name)
    if tier is None:
        return None
    return DecodeKernel(name, NativeDecode(tier))


def native_kernels(kv_dtype: torch.dtype) -> list[str]:
    """The native decode-attention kernels that run here for this KV dtype (the widest loaded tier)."""
    if kv_dtype not in NATIVE_KV_DTYPES:
        return []
    for tier in runnable_tiers():
        if native_op(tier.name, "paged_decode_attention") is not None:
            return [NATIVE_PREFIX + tier.name]
    return []


def _inputs(shape: tuple[int, int], num_heads: int, cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A batch of `shape` = (sequences, tokens) decode rows over random blocks of `cache`."""
    rows, tokens = shape
    _, _, blocks, block_size, _ = cache.shape
    head_dim = cache_head_dim(cache)
    width = -(-tokens // block_size)
    generator = torch.Generator().manual_seed(0)
    table = torch.randint(0, blocks, (rows, width), generator=generator)
    seq_lens = torch.full((rows,), tokens, dtype=torch.long)
    return torch.randn(rows, num_heads * head_dim, generator=generator), table, seq_lens


def _time_us(call: Callable[[], object], reps: int = 5) -> float:
    call()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def choose_decode_attention(
    kv_cache: torch.Tensor, num_heads: int, cache: KernelChoiceCache, torch_form: Callable[..., torch.Tensor]
) -> tuple[str, dict[str, Any]]:
    """(the decode-attention kernel for caches like `kv_cache` with `num_heads` query heads, its choice record): the
    faster over TIMED_SHAPES in total of `torch_form(q, kv_cache, block_table, seq_lens, window, softcap)`
    (kiln.model.graph_attention's traced form) and the native kernel; the torch form where no native kernel runs.
    The key holds the native sources' hash: a changed kernel is timed again. The torch form is timed as the
    paged-attention op runs it (uncompiled); inside a full decode graph inductor fuses it, and there the native
    kernel measured 0.55-1.0x its time here (docs/benchmarks.md), so one choice serves both."""
    _, kv_heads, _, block_size, _ = kv_cache.shape
    head_dim = cache_head_dim(kv_cache)
    kernels = native_kernels(kv_cache.dtype)
    if not kernels or kv_cache.device.type != "cpu" or kv_heads == 0:
        return TORCH, {"winner": TORCH, "why": "no native kernel runs here for this cache"}
    applies_to = {
        "heads": num_heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "block_size": block_size,
        "kv_dtype": kv_dtype_name(kv_cache.dtype),
        "native": source_hash(),
    }

    def measure() -> dict[str, Any]:
        longest = max(-(-t // block_size) * r for r, t in TIMED_SHAPES)
        sample = pack_rows(torch.randn(2, kv_heads, longest + 1, block_size, head_dim), kv_cache.dtype)
        times: dict[str, float] = {}
        for kernel in [TORCH, *kernels]:
            tier = native_tier(kernel)
            total = 0.0
            for shape in TIMED_SHAPES:
                q, table, seq_lens = _inputs(shape, num_heads, sample)
                args = (q, sample, table, seq_lens, 0, 0.0)
                total += _time_us(partial(torch_form if tier is None else NativeDecode(tier), *args))
            times[kernel] = round(total, 1)
        return {"times_us": times, "winner": min(times, key=times.__getitem__), "shapes": list(TIMED_SHAPES)}

    record = cache.choose("decode_attention", applies_to, measure)
    return str(record["winner"]), record
