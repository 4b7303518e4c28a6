"""Attention's kernels, timed on this machine: decode rows' and prompts' (prefill), torch forms or kiln's native ones.

The native kernels (kiln/kernels/native/paged_attention.cpp) read each sequence's keys and values where they lie in
the paged cache. Decode's torch form gathers the blocks of every sequence, padded to the longest, and multiplies
them; prefill's (kiln.model.prefill_attention) gathers each group of prompts' context and runs a masked SDPA.
`choose_decode_attention` and `choose_prefill_attention` time the two over the engine's own cache geometry (heads,
KV heads, head dim, block size, KV dtype) at a few batch shapes, once per machine (kiln.kernels.choices), and the
plan hands the winners to the step's forward context (`ForwardContext.decode_kernel`, a `DecodeKernel`;
`ForwardContext.prefill_kernel`, a `PrefillKernel`): the paged-attention op calls them at run time, a full decode
graph its decode kernel at trace time, so the native kernel is one node in the graph (the tier's C++ op).
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
from kiln.model.forward_context import DecodeKernel, PrefillKernel
from kiln.model.kv_format import cache_head_dim, kv_dtype_name, pack_rows

TORCH = "torch"
NATIVE_PREFIX = "native-"
# every KV cache dtype (kiln.model.kv_format): int8 and fp8_e4m3 (held as uint8) with their scales
NATIVE_KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8)
# (sequences, tokens each) timed for the choice: one long sequence, a small batch, a large one
TIMED_SHAPES = ((1, 1024), (8, 256), (32, 256))
# (sequences, new tokens each, cached context each) timed for the prefill choice: a fresh prompt, a chunk over a long
# context (chunked prefill beside decodes), a few prompts over a cached prefix
PREFILL_SHAPES = ((1, 512, 0), (1, 16, 2048), (8, 64, 192))


class NativeAttention:
    """One of the native tier `tier`'s attention ops (`op`), called with q [tokens, heads * head_dim] of any float
    dtype: it computes in float32 and answers in q's dtype."""

    def __init__(self, tier: str, op: str) -> None:
        self.tier = tier
        self.op = _graph_op(tier, op) if tier in TIER_NAMES else None

    def _run(self, q: torch.Tensor, kv_cache: torch.Tensor, operands: tuple[object, ...]) -> torch.Tensor:
        """The op over q (as [tokens, heads, head_dim] float32), the cache and the op's other `operands`."""
        if self.op is None:
            raise RuntimeError(f"the native {self.tier} tier is not loaded here, but the kernel plan chose it")
        head_dim = cache_head_dim(kv_cache)
        return self.op(q.float().view(q.shape[0], -1, head_dim), kv_cache, *operands).to(q.dtype)


class NativeDecode(NativeAttention):
    """The native tier `tier`'s decode attention: q [n, heads * head_dim] -> [n, heads * head_dim], row i over the
    first seq_lens[i] keys of its blocks (`block_table[i]`), as kiln.model.graph_attention's traced form. Called the
    same way at run time and in a traced graph, where the C++ op is one node (its fake is registered here): no
    Python custom op's dispatch in between (~0.1 ms a call, 30 layers a step)."""

    def __init__(self, tier: str) -> None:
        super().__init__(tier, "paged_decode_attention")

    def __call__(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        window: int,
        softcap: float,
    ) -> torch.Tensor:
        return self._run(q, kv_cache, (block_table, seq_lens, window, softcap))


class NativePrefill(NativeAttention):
    """The native tier `tier`'s prefill attention, kiln.model.prefill_attention's grouped form in one call: q
    [tokens, heads * head_dim], sequence i's queries its rows [query_start[i], query_start[i + 1]), the last of its
    seq_lens[i] tokens, causal from its context, its keys in its blocks (`block_table[i]`)."""

    def __init__(self, tier: str) -> None:
        super().__init__(tier, "paged_prefill_attention")

    def __call__(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start: torch.Tensor,
        window: int,
        softcap: float,
    ) -> torch.Tensor:
        return self._run(q, kv_cache, (block_table, seq_lens, query_start, window, softcap))


@functools.cache
def _graph_op(tier: str, name: str) -> Callable[..., torch.Tensor] | None:
    """The tier's C++ op `name`, with the fake (shape-only) form a traced graph needs; None where it is not loaded."""
    op = native_op(tier, name)
    if op is not None:

        def fake(q, kv_cache, *operands):
            return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])

        torch.library.register_fake(f"{tier_by_name(tier).namespace}::{name}", fake)
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


@functools.cache
def prefill_kernel(name: str) -> PrefillKernel | None:
    """The kernel a plan's prefill-attention name runs (None: the grouped torch form)."""
    tier = native_tier(name)
    if tier is None:
        return None
    return PrefillKernel(name, NativePrefill(tier))


def native_kernels(kv_dtype: torch.dtype, op: str = "paged_decode_attention") -> list[str]:
    """The native kernels of attention op `op` that run here for this KV dtype (the widest loaded tier)."""
    if kv_dtype not in NATIVE_KV_DTYPES:
        return []
    for tier in runnable_tiers():
        if native_op(tier.name, op) is not None:
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


def best_time_us(call: Callable[[], object], reps: int = 5) -> float:
    """The fastest of `reps` calls of `call` after a warm-up call, in microseconds."""
    call()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def _timed_choice(
    what: str,
    kv_cache: torch.Tensor,
    num_heads: int,
    cache: KernelChoiceCache,
    kernels: list[str],
    blocks: int,
    time_kernel: Callable[[str, torch.Tensor], float],
) -> tuple[str, dict[str, Any]]:
    """(the faster of the torch form and `kernels` by `time_kernel(name, sample)` microseconds, its record) for
    attention `what` over caches like `kv_cache` with `num_heads` query heads, each timed over one sample cache of
    `blocks` random blocks; the torch form where no native kernel runs. The key holds the native sources' hash: a
    changed kernel is timed again."""
    _, kv_heads, _, block_size, _ = kv_cache.shape
    if not kernels or kv_cache.device.type != "cpu" or kv_heads == 0:
        return TORCH, {"winner": TORCH, "why": "no native kernel runs here for this cache"}
    applies_to = {
        "heads": num_heads,
        "kv_heads": kv_heads,
        "head_dim": cache_head_dim(kv_cache),
        "block_size": block_size,
        "kv_dtype": kv_dtype_name(kv_cache.dtype),
        "native": source_hash(),
    }

    def measure() -> dict[str, Any]:
        sample = _sample_cache(kv_cache, blocks)
        times = {kernel: round(time_kernel(kernel, sample), 1) for kernel in [TORCH, *kernels]}
        return {"times_us": times, "winner": min(times, key=times.__getitem__)}

    record = cache.choose(what, applies_to, measure)
    return str(record["winner"]), record


def _sample_cache(kv_cache: torch.Tensor, blocks: int) -> torch.Tensor:
    """A cache of `blocks` random blocks (and the null block) shaped and stored as `kv_cache`'s."""
    _, kv_heads, _, block_size, _ = kv_cache.shape
    values = torch.randn(2, kv_heads, blocks + 1, block_size, cache_head_dim(kv_cache))
    return pack_rows(values, kv_cache.dtype)


def choose_decode_attention(
    kv_cache: torch.Tensor, num_heads: int, cache: KernelChoiceCache, torch_form: Callable[..., torch.Tensor]
) -> tuple[str, dict[str, Any]]:
    """(the decode-attention kernel for caches like `kv_cache` with `num_heads` query heads, its choice record): the
    faster over TIMED_SHAPES in total of `torch_form(q, kv_cache, block_table, seq_lens, window, softcap)`
    (kiln.model.graph_attention's traced form) and the native kernel. The torch form is timed as the paged-attention
    op runs it (uncompiled); inside a full decode graph inductor fuses it, and there the native kernel measured
    0.55-1.0x its time here (docs/benchmarks.md), so one choice serves both."""
    block_size = kv_cache.shape[3]

    def time_kernel(kernel: str, sample: torch.Tensor) -> float:
        tier = native_tier(kernel)
        form = torch_form if tier is None else NativeDecode(tier)
        total = 0.0
        for shape in TIMED_SHAPES:
            q, table, seq_lens = _inputs(shape, num_heads, sample)
            total += best_time_us(partial(form, q, sample, table, seq_lens, window=0, softcap=0.0))
        return total

    return _timed_choice(
        "decode_attention",
        kv_cache,
        num_heads=num_heads,
        cache=cache,
        kernels=native_kernels(kv_cache.dtype),
        blocks=max(-(-t // block_size) * r for r, t in TIMED_SHAPES),
        time_kernel=time_kernel,
    )


def _prefill_inputs(shape: tuple[int, int, int], num_heads: int, cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(q, block_table, seq_lens, query_start) of `shape` = (sequences, new tokens each, cached context each) over
    random blocks of `cache`."""
    sequences, new, context = shape
    _, _, blocks, block_size, _ = cache.shape
    generator = torch.Generator().manual_seed(0)
    table = torch.randint(0, blocks, (sequences, -(-(new + context) // block_size)), generator=generator)
    seq_lens = torch.full((sequences,), new + context, dtype=torch.long)
    q = torch.randn(sequences * new, num_heads * cache_head_dim(cache), generator=generator)
    return q, table, seq_lens, torch.arange(sequences + 1) * new


def choose_prefill_attention(
    kv_cache: torch.Tensor, num_heads: int, cache: KernelChoiceCache, torch_form: Callable[..., torch.Tensor]
) -> tuple[str, dict[str, Any]]:
    """(the prefill-attention kernel for caches like `kv_cache` with `num_heads` query heads, its choice record): the
    faster over PREFILL_SHAPES in total of `torch_form(q, kv_cache, block_table, seq_lens, query_start, window,
    softcap)` (kiln.model.prefill_attention's grouped form) and the native kernel."""
    block_size = kv_cache.shape[3]

    def time_kernel(kernel: str, sample: torch.Tensor) -> float:
        tier = native_tier(kernel)
        form = torch_form if tier is None else NativePrefill(tier)
        total = 0.0
        for shape in PREFILL_SHAPES:
            q, table, seq_lens, query_start = _prefill_inputs(shape, num_heads, sample)
            call = partial(form, q, sample, table, seq_lens, query_start=query_start, window=0, softcap=0.0)
            total += best_time_us(call, reps=3)
        return total

    return _timed_choice(
        "prefill_attention",
        kv_cache,
        num_heads=num_heads,
        cache=cache,
        kernels=native_kernels(kv_cache.dtype, "paged_prefill_attention"),
        blocks=max(-(-(n + c) // block_size) * s for s, n, c in PREFILL_SHAPES),
        time_kernel=time_kernel,
    )
