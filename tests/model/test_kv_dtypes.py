"""Every KV cache dtype (kiln.model.kv_format) through every attention path, against a plain-torch reference of the
same arithmetic: dense attention over the values the cache holds, read back from its bytes here (int8 codes, or
fp8 e4m3 codes decoded by their definition, times the float32 scale after them), not by kiln's own unpacking.

The paths: the paged-attention op's prefill (whole prompts, chunks after cached context, decodes beside chunks) and
decode (the torch form, and kiln's native kernel on every tier this CPU runs), and the full decode graph's traced
attention (traced whole). The stored values are also held to each format's rounding bound against the K/V written.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kiln.model.attention  # noqa: F401  (registers torch.ops.kiln.attention)
from kiln.compile.settings import graph_config_from
from kiln.engine.running.model_runner import ModelRunner
from kiln.executor.base import Executor
from kiln.executor.eager import EagerExecutor
from kiln.executor.graph import GraphExecutor
from kiln.kernels.attention import NATIVE_PREFIX, TORCH, decode_kernel
from kiln.kernels.native.build import native_op, runnable_tiers
from kiln.model.attention import allocate_kv_caches, kv_cache_shape
from kiln.model.forward_context import DecodeInputs, ForwardContext, set_forward_context
from kiln.model.graph_attention import decode_attention
from kiln.model.kv_format import STORAGE, cache_head_dim, kv_dtype_name, kv_storage_dtype, pack_rows
from tests.compile.tiny import BLOCK_SIZE as RUNNER_BLOCK
from tests.compile.tiny import NUM_BLOCKS as NUM_RUNNER_BLOCKS
from tests.compile.tiny import generate, random_prompts, tiny_config, tiny_model
from tests.model.test_sliding_window import (
    BLOCK_SIZE,
    HEAD_DIM,
    LENGTHS,
    NULL_BLOCK,
    NUM_BLOCKS,
    NUM_KV_HEADS,
    STEPS,
    TABLES,
    dense_attention,
    sequences,
    slot,
    step_metadata,
)

DTYPES = list(STORAGE.values())
IDS = list(STORAGE)
TIERS = [t.name for t in runnable_tiers() if native_op(t.name, "paged_decode_attention") is not None]
DECODERS = [None, *(NATIVE_PREFIX + t for t in TIERS)]  # the op's torch form, then each native tier


def e4m3_values() -> torch.Tensor:
    """The value of each of the 256 float8_e4m3fn codes, from the format's definition (sign, 4 exponent bits of bias
    7, 3 mantissa bits; exponent 0 subnormal); the NaN codes (0x7F, 0xFF) as NaN."""
    out = []
    for b in range(256):
        sign, exponent, mantissa = -1.0 if b & 0x80 else 1.0, (b >> 3) & 0xF, b & 0x7
        if exponent == 0xF and mantissa == 0x7:
            out.append(float("nan"))
        elif exponent == 0:
            out.append(sign * mantissa / 8 * 2.0**-6)
        else:
            out.append(sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return torch.tensor(out, dtype=torch.float64)


def held_values(cache: torch.Tensor, seq: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, v) [length, kv_heads * head_dim] float32: what `cache` holds for sequence `seq`, decoded here."""
    width = cache.shape[-1]
    rows = cache.view(2, NUM_KV_HEADS, -1, width)[:, :, [slot(seq, p) for p in range(length)]]  # [2, Hkv, n, W]
    if cache.dtype in (torch.int8, torch.uint8):
        raw = rows.contiguous().view(torch.uint8)
        scale = raw[..., HEAD_DIM:].contiguous().view(torch.float32).double()  # the 4 bytes after the codes
        codes = raw[..., :HEAD_DIM]
        values = codes.view(torch.int8).double() if cache.dtype == torch.int8 else e4m3_values()[codes.long()]
        rows = (values * scale).float()
    kv = rows.float().transpose(1, 2).reshape(2, length, NUM_KV_HEADS * HEAD_DIM)
    return kv[0], kv[1]


def run_steps(steps: list[list[tuple[int, int]]], dtype: torch.dtype, kernel: str | None) -> None:
    """Runs `steps` through the paged-attention op over a cache of `dtype` (decodes with `kernel`), then checks
    every output row against dense attention over the values the cache holds."""
    seqs = sequences()
    cache = torch.zeros(kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype), dtype=dtype)
    context = [0] * len(seqs)
    outputs: list[list[torch.Tensor]] = [[] for _ in seqs]
    for step in steps:
        entries = [(s, context[s], new) for s, new in step]
        meta = step_metadata(entries)
        q, k, v = (torch.cat([seqs[s][t][c : c + new] for s, c, new in entries]) for t in range(3))
        ctx = ForwardContext(meta, [cache], decode_kernel=decode_kernel(kernel) if kernel else None)
        with set_forward_context(ctx):
            out = torch.ops.kiln.attention(q, k, v, 0)
        for (s, _, new), start in zip(entries, meta.query_start_loc[:-1], strict=True):
            outputs[s].append(out[start : start + new])
            context[s] += new
    for s, (q, _, _) in enumerate(seqs):
        n = context[s]
        k, v = held_values(cache, s, n)
        want = dense_attention(q[:n], k, v, 0)
        torch.testing.assert_close(torch.cat(outputs[s]), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("name", ["whole_prompts", "chunked_prefill", "decodes_beside_chunks"])
def test_prefill_attends_over_the_stored_values(dtype: torch.dtype, name: str) -> None:
    run_steps(STEPS[name], dtype, None)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("kernel", DECODERS, ids=lambda k: k or "torch")
def test_decode_attends_over_the_stored_values(dtype: torch.dtype, kernel: str | None) -> None:
    run_steps(STEPS["decode_only"], dtype, kernel)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_traced_decode_attention_reads_every_dtype(dtype: torch.dtype) -> None:
    """The full decode graph's attention, traced whole (`fullgraph=True`): prefill 8 and 6 tokens with the op, then
    decode to the sequences' ends over a fixed-width table with a padding row on the null block."""
    seqs = sequences()
    cache = torch.zeros(kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype), dtype=dtype)
    torch._dynamo.reset()  # each dtype traces afresh (the recompile limit counts across the parameters)
    attend = torch.compile(decode_attention, fullgraph=True, backend="eager", dynamic=False)
    context = [8, 6]
    meta = step_metadata([(0, 0, 8), (1, 0, 6)])
    q, k, v = (torch.cat([seqs[s][t][: context[s]] for s in (0, 1)]) for t in range(3))
    with set_forward_context(ForwardContext(meta, [cache])):
        torch.ops.kiln.attention(q, k, v, 0)
    table = torch.tensor([t + [NULL_BLOCK] * (5 - len(t)) for t in TABLES] + [[NULL_BLOCK] * 5])
    rows: list[tuple[int, int, torch.Tensor]] = []
    while context[0] < LENGTHS[0]:
        live = [s for s in (0, 1) if context[s] < LENGTHS[s]]
        decode = DecodeInputs(torch.tensor([context[s] + 1 for s in live] + [1]), table[[*live, 2]])
        q, k, v = (
            torch.cat([seqs[s][t][context[s] : context[s] + 1] for s in live] + [seqs[0][t][:1]]) for t in range(3)
        )
        out = attend(q, k, v, cache, decode)
        assert out[len(live)].isfinite().all()
        for row, s in enumerate(live):
            rows.append((s, context[s], out[row]))
            context[s] += 1
    for s, position, got in rows:
        k, v = held_values(cache, s, position + 1)
        want = dense_attention(seqs[s][0][: position + 1], k, v, 0)[-1]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# each format's rounding bound on a stored value x' of x, with s = max|x| / qmax over x's row
BOUNDS = {
    torch.float32: lambda x, s: torch.zeros_like(x),
    torch.bfloat16: lambda x, s: x.abs() * 2.0**-8,
    torch.float16: lambda x, s: x.abs() * 2.0**-11 + 2.0**-25,
    torch.int8: lambda x, s: s / 2,
    torch.uint8: lambda x, s: x.abs() * 2.0**-4 + s * 2.0**-10,  # 3 mantissa bits; subnormal steps of s / 512
}


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_stored_values_round_within_the_format(dtype: torch.dtype) -> None:
    seqs = sequences()
    cache = torch.zeros(kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype), dtype=dtype)
    meta = step_metadata([(s, 0, n) for s, n in enumerate(LENGTHS)])
    q, k, v = (torch.cat([seqs[s][t] for s in (0, 1)]) for t in range(3))
    with set_forward_context(ForwardContext(meta, [cache])):
        torch.ops.kiln.attention(q, k, v, 0)
    for s, (_, k_in, v_in) in enumerate(seqs):
        held = torch.stack(held_values(cache, s, LENGTHS[s]))
        written = torch.stack((k_in, v_in)).view(2, -1, NUM_KV_HEADS, HEAD_DIM)
        scale = written.abs().amax(-1, keepdim=True) / (127 if dtype == torch.int8 else 448)
        bound = BOUNDS[dtype](written, scale).expand_as(written).reshape(held.shape)
        assert ((held - written.reshape(held.shape)).abs() <= bound * (1 + 1e-6)).all()
        if dtype in (torch.int8, torch.uint8):  # each row's largest value is a full-scale code
            peak = held.view(2, -1, NUM_KV_HEADS, HEAD_DIM).abs().amax(-1)
            torch.testing.assert_close(peak, written.abs().amax(-1), rtol=1e-6, atol=0)


def test_the_cache_and_its_bytes_follow_the_dtype() -> None:
    """int8 and fp8_e4m3 rows carry 4 bytes of scale; the allocation, the head dim read back and the memory estimate
    (ModelConfig.kv_bytes_per_token) agree on it; `auto` is bfloat16 for a float32 model, else the model's."""
    config = tiny_config()
    for name, dtype in STORAGE.items():
        (cache, *_) = allocate_kv_caches(config, 3, 4, dtype, "cpu")
        assert cache.dtype == dtype and cache_head_dim(cache) == config.head_dim
        per_token = config.kv_bytes_per_token(dtype)
        assert cache[:, :, :3].numel() * cache.element_size() == 3 * 4 * per_token // config.num_layers, name
    assert config.kv_bytes_per_token(torch.int8) == config.kv_bytes_per_token(torch.bfloat16) // 2 + 2 * 4 * 2 * 2
    assert kv_storage_dtype("auto", torch.float32) == torch.float32  # kiln.config.AUTO_KV_CACHE_DTYPE's note
    assert kv_storage_dtype("auto", torch.float16) == torch.float16
    assert kv_storage_dtype("fp8_e4m3", torch.float32) == torch.uint8
    assert kv_storage_dtype("auto", torch.float64) == torch.float64  # the debugger's reference engine
    assert kv_dtype_name(torch.float64) == "float64" and kv_dtype_name(torch.uint8) == "fp8_e4m3"
    assert pack_rows(torch.zeros(3, 8), torch.int8).eq(0).view(3, -1)[:, :8].all()  # a zero row stays zero


def _runner(model: torch.nn.Module, kv_dtype: torch.dtype, executor: Executor) -> ModelRunner:
    runner = ModelRunner(model, executor, NUM_RUNNER_BLOCKS, RUNNER_BLOCK, kv_dtype, eos_token_ids=())
    runner.prepare_executor()
    return runner


def test_full_decode_graphs_compile_the_fp8_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8_e4m3, the format with the most bit-level reads (uint8 codes viewed as float8, the scale's bytes as
    float32), through inductor's full decode graphs and pieces: the eager steps' tokens, with the torch form of
    decode attention inside the graph."""
    monkeypatch.setattr("kiln.kernels.plan.choose_decode_attention", lambda *a: (TORCH, {"winner": TORCH}))
    model = tiny_model(num_layers=1)
    prompts = random_prompts([5, 3, 9])
    expected = generate(_runner(model, torch.uint8, EagerExecutor(keep_layout=True)), prompts, 8)
    config = graph_config_from(
        None, cache_dir=str(tmp_path), mode="full_and_piecewise", capture_sizes=(4,), compile_sizes=()
    )
    graph = GraphExecutor(config)
    assert generate(_runner(model, torch.uint8, graph), prompts, 8) == expected
    assert graph.counters.full_replays > 0
