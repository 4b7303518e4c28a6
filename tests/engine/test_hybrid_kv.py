"""Sliding-window layers alternating with global ones (Gemma 2): the sliding layers keep their KV in a pool of their
own, released behind the window, while the global layers' pool grows with the sequence.

A tiny random HF Gemma 2 (window 8, 4-token blocks, layers 0 and 2 sliding) generates greedy tokens past several
windows; every token is checked against HF's own forward over the prompt and the tokens before it, so no released
block was ever read. The sliding layers' caches are allocated smaller, the budget they leave goes to the global
layers, a sequence holds a bounded number of sliding blocks in eager, piecewise and full-decode-graph modes, and
preemption releases both pools.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.config import CacheConfig, SchedulerConfig
from kiln.engine.running.kv_plan import kv_cache_blocks
from kiln.engine.scheduling.kv_window import max_decode_blocks, window_pool_blocks
from tests.engine.test_sliding_kv import generate_stepwise
from tests.model.test_gemma import LONG, SHORT, write_gemma

WINDOW, BLOCK = 8, 4  # test_gemma's TINY window; tests.engine.test_sliding_kv's block size
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
SMALL = dict(block_size=BLOCK, max_num_seqs=2, max_num_batched_tokens=8)  # chunked prefill of 8-token chunks


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("gemma2")
    return path, write_gemma(path, "gemma2")


def assert_hf_greedy(hf: torch.nn.Module, prompt: list[int], tokens: list[int]) -> None:
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    assert tokens == logits.argmax(-1).tolist()


def test_budget_split_gives_the_global_layers_what_the_window_does_not_need(gemma) -> None:
    llm = LLM(str(gemma[0]), kv_cache_memory_gb=0.001, graph_mode="eager", **SMALL)
    model, engine = llm.engine.model, llm.engine
    bytes_per_block_layer = 2 * 2 * 16 * 4 * BLOCK  # K and V, 2 KV heads of 16 fp32 values, per token of a block
    uniform = int(0.001 * 1e9) // (bytes_per_block_layer * 4)  # what each of the 4 layers would get without the split
    window = window_pool_blocks(WINDOW, BLOCK, 2, 8)
    assert engine.window_pool.num_blocks == window < uniform
    assert engine.pool.num_blocks == (int(0.001 * 1e9) // bytes_per_block_layer - 2 * window) // 2 > uniform
    assert [c.shape[2] - 1 for c in engine.runner.kv_caches] == [window, engine.pool.num_blocks] * 2
    assert engine.runner.kv_cache_bytes - 4 * bytes_per_block_layer <= 0.001 * 1e9  # each layer's null block aside
    # an explicit block count is the global layers' (the budget unused); the sliding ones never take more than they need
    cc, sc = CacheConfig(BLOCK, num_blocks=500), SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8)
    assert kv_cache_blocks(cc, sc, model, torch.float32, budget=0) == (500, window)
    assert kv_cache_blocks(CacheConfig(BLOCK, num_blocks=5), sc, model, torch.float32, budget=0) == (5, 5)


@pytest.mark.parametrize("mode", ["eager", "piecewise", "full_and_piecewise"])
def test_sliding_blocks_stay_within_the_window_in_every_mode(gemma, mode: str) -> None:
    path, hf = gemma
    graph = {} if mode == "eager" else dict(compiler="eager", capture_sizes=(1, 2))
    llm = LLM(str(path), num_kv_blocks=64, graph_mode=mode, **SMALL, **graph)
    tokens, (global_live, window_live) = generate_stepwise(llm, LONG, GREEDY)
    assert_hf_greedy(hf, LONG, tokens)
    assert global_live == -(-(len(LONG) + len(tokens) - 1) // BLOCK)  # every computed token's block
    # a decode holds the window's blocks plus one; a prefill chunk of 8 tokens at most 2 more
    assert max_decode_blocks(WINDOW, BLOCK) <= window_live <= max_decode_blocks(WINDOW, BLOCK) + 2
    counters = llm.engine.executor.counters
    if mode == "full_and_piecewise":
        assert counters.full_replays > 0  # the traced decode attention read the sliding layers' own table
    elif mode == "piecewise":
        assert counters.replays > 0


def test_a_sequence_longer_than_the_sliding_pool(gemma) -> None:
    """60 tokens against a sliding pool of 10 blocks (40 tokens): 2 sequences x (3 live + 1 new) blocks, plus the 2
    of an 8-token step; released blocks are reused by the same sequence."""
    path, hf = gemma
    llm = LLM(str(path), num_kv_blocks=64, graph_mode="eager", **SMALL)
    assert llm.engine.window_pool.num_blocks == 10
    out = llm.generate(LONG, GREEDY)[0]
    assert out.error is None and len(LONG) + len(out.token_ids) > 10 * BLOCK
    assert_hf_greedy(hf, LONG, out.token_ids)
    assert llm.engine.scheduler.num_preemptions == 0


def test_preemption_releases_both_pools(gemma) -> None:
    """Three sequences of 43 tokens (11 blocks each) in a global pool of 24: some are preempted and recomputed."""
    path, hf = gemma
    prompts = [SHORT[:3], SHORT[3:6], LONG[:3]]
    llm = LLM(
        str(path), num_kv_blocks=24, block_size=BLOCK, max_num_seqs=3, max_num_batched_tokens=8, graph_mode="eager"
    )
    outs = llm.generate(prompts, GREEDY)
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert_hf_greedy(hf, prompt, out.token_ids)
    for pool in (engine.pool, engine.window_pool):
        assert pool.num_free_blocks == pool.num_blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_full_decode_graphs_read_the_sliding_layers_table(gemma) -> None:
    """On CUDA the full decode graphs are CUDA graphs over persistent buffers: the sliding layers' table is one more
    view of the uploaded buffer, captured per table width."""
    path, hf = gemma
    llm = LLM(str(path), device="cuda", num_kv_blocks=64, enable_piecewise_graph=True, capture_sizes=(1, 2), **SMALL)
    tokens = llm.generate(LONG, GREEDY)[0].token_ids
    assert_hf_greedy(hf, LONG, tokens)
    assert llm.engine.executor.counters.full_replays > 0 and llm.engine.executor.counters.full_graphs_captured > 0
