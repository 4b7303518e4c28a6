"""Decode attention of a full decode graph, the forms side by side: kiln's block-table gather (products and sums,
kiln.model.graph_attention), PyTorch's FlexAttention over the paged cache (a BlockMask built from the block
table, a mask_mod mapping physical KV slots back to logical positions) and, on CPU, kiln's native paged kernel
(kiln/kernels/native/paged_attention.cpp, one node of the graph). One layer of SmolLM2-135M's shape
(9 query heads, 3 KV heads, head_dim 64, 16-token blocks), each form compiled once per shape with inductor
(fullgraph), timed after warm-up; outputs checked against the gather form. On CPU each row also gives the
KV-streaming roofline: the K/V bytes the step must read over the read bandwidth `kiln bench` measures.

Usage: python scripts/attention_bench.py [--device cpu|cuda] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from kiln.bench.roofline import read_bandwidth_gbs
from kiln.kernels.attention import decode_kernel, native_kernels
from kiln.model.forward_context import DecodeInputs
from kiln.model.graph_attention import decode_attention, decode_slots

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
BLOCK = int(os.environ.get("KILN_BENCH_BLOCK", "16"))  # KV-cache block (page) size
CASES = [(1, 128), (1, 1024), (8, 512), (32, 256), (32, 1024)]  # (batch, context tokens per sequence)


def flex_decode(q, k, v, kv_cache, seq_lens, table):
    """The same step as decode_attention (cache write included), attention by flex_attention on the paged cache."""
    n, width = table.shape
    num_phys = kv_cache.shape[2]
    flat = kv_cache.view(2, KV_HEADS, -1, HEAD_DIM)
    new = torch.stack((k, v)).view(2, n, KV_HEADS, HEAD_DIM).transpose(1, 2).to(kv_cache.dtype)
    flat.index_copy_(2, decode_slots(seq_lens, table, BLOCK), new)
    phys_to_logical = torch.full((n, num_phys), -1, dtype=torch.int64, device=q.device)
    phys_to_logical.scatter_(1, table, torch.arange(width, device=q.device).expand(n, width).contiguous())

    def mask_mod(b, h, q_idx, kv_idx):
        logical = phys_to_logical[b, kv_idx // BLOCK]
        return (logical >= 0) & (logical * BLOCK + kv_idx % BLOCK < seq_lens[b])

    used = (seq_lens + BLOCK - 1) // BLOCK
    indices = torch.zeros(n, 1, 1, num_phys, dtype=torch.int32, device=q.device)  # flex wants every KV block
    indices[..., :width] = table.view(n, 1, 1, width)
    mask = BlockMask.from_kv_blocks(
        used.view(n, 1, 1).to(torch.int32),
        indices,
        BLOCK_SIZE=(BLOCK, BLOCK),
        mask_mod=mask_mod,
        seq_lengths=(1, flat.shape[2]),
    )
    out = flex_attention(
        q.view(n, HEADS, 1, HEAD_DIM) * HEAD_DIM**-0.5,  # a computed buffer: inductor's CPU lowering wants one
        flat[0][None],
        flat[1][None],
        block_mask=mask,
        enable_gqa=True,
        scale=1.0,
        # NOTE: triton's tiles must divide the 16-token pages (the default tiles are 64-128)
        kernel_options={"BLOCK_M": BLOCK, "BLOCK_N": BLOCK} if q.is_cuda else None,
    )
    return out.transpose(1, 2).reshape(n, HEADS * HEAD_DIM)


def gather_decode(q, k, v, kv_cache, seq_lens, table):
    return decode_attention(q, k, v, kv_cache, DecodeInputs(seq_lens=seq_lens, block_table=table))


def native_form(name: str):
    kernel = decode_kernel(name)

    def native_decode(q, k, v, kv_cache, seq_lens, table):
        return decode_attention(q, k, v, kv_cache, DecodeInputs(seq_lens=seq_lens, block_table=table), kernel=kernel)

    return native_decode


def timed(fn, args, device: str, iters: int) -> float:
    """Mean µs per call; on CUDA of a CUDA graph replaying the call (device time, as in a captured decode graph)."""
    for _ in range(3):
        fn(*args)
    if device == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(*args)
        fn = graph.replay
        args = ()
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn(*args)
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out")
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    dev = args.device
    torch.manual_seed(0)
    forms = [("gather", gather_decode), ("flex", flex_decode)]
    native = native_kernels(torch.float32) if dev == "cpu" else []
    forms += [("native", native_form(native[0]))] if native else []
    bandwidth = read_bandwidth_gbs() if dev == "cpu" else 0.0
    rows = []
    for batch, context in CASES:
        width = context // BLOCK
        num_blocks = batch * width + 1  # plus the null block
        cache = torch.randn(2, KV_HEADS, num_blocks, BLOCK, HEAD_DIM, device=dev)
        table = torch.randperm(num_blocks - 1, device=dev)[: batch * width].view(batch, width)
        seq_lens = torch.full((batch,), context - 3, device=dev)
        q = torch.randn(batch, HEADS * HEAD_DIM, device=dev)
        k, v = torch.randn(2, batch, KV_HEADS * HEAD_DIM, device=dev)
        row: dict[str, object] = {"device": dev, "batch": batch, "context": context}
        outs = {}
        for name, fn in forms:
            compiled = torch.compile(fn, fullgraph=True, dynamic=False)
            call = (q, k, v, cache, seq_lens, table)
            try:
                outs[name] = compiled(*call)
                row[f"{name}_us"] = round(timed(compiled, call, dev, args.iters), 1)
            except Exception as exc:  # a form that does not compile here is reported, not fatal
                row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        for name in outs.keys() - {"gather"}:
            row[f"{name}_max_abs_diff"] = float((outs["gather"] - outs[name]).abs().max())
            row[f"{name}_over_gather"] = round(row[f"{name}_us"] / row["gather_us"], 2)
        if bandwidth:  # K and V of every visible key, fp32
            row["roofline_us"] = round(batch * (context - 3) * KV_HEADS * HEAD_DIM * 2 * 4 / (bandwidth * 1e3), 1)
            if "native_us" in row:
                row["native_over_roofline"] = round(row["native_us"] / row["roofline_us"], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
