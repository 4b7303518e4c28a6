"""How large the KV cache is: a fraction of the memory available after the weights (vLLM's
--gpu-memory-utilization, of free memory), an absolute size, or a block count, each winning over the one before,
and the start-up line that says which one chose it."""

from __future__ import annotations

import argparse

import pytest
import torch

from kiln import LLM
from kiln.config import CacheConfig
from kiln.engine.running.kv_plan import kv_budget
from kiln.engine.setup.arg_types import fraction
from kiln.platforms import CpuPlatform
from tests.engine.tiny_models import write_hf_model

CPU = torch.device("cpu")


@pytest.fixture
def twenty_gb_free(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(CpuPlatform, "available_memory_gb", lambda self, device: 20.0)


def test_each_flag_wins_over_the_one_before(twenty_gb_free) -> None:
    assert kv_budget(CacheConfig(), CPU) == (1_000_000_000, "the default 1 GB; 20.0 GB available after the weights")
    frac = kv_budget(CacheConfig(kv_cache_memory_fraction=0.25), CPU)
    assert frac == (5_000_000_000, "--kv-cache-memory-fraction 0.25 of the 20.0 GB available after the weights")
    both = kv_budget(CacheConfig(kv_cache_memory_gb=2.0, kv_cache_memory_fraction=0.25), CPU)
    assert both[0] == 2_000_000_000 and both[1].startswith("--kv-cache-memory-gb 2 GB")
    blocks = kv_budget(CacheConfig(num_blocks=64, kv_cache_memory_fraction=0.25), CPU)
    assert blocks[1].startswith("--num-kv-blocks or the recipe's pages")
    # the ranks of one CPU machine share its RAM
    shared = kv_budget(CacheConfig(kv_cache_memory_fraction=0.5), CPU, ranks_on_node=2)
    assert shared[0] == 5_000_000_000 and shared[1].endswith("weights, 10.0 GB for each of 2 ranks")


def test_more_than_is_available_is_warned(twenty_gb_free, kiln_log: pytest.LogCaptureFixture) -> None:
    kv_budget(CacheConfig(kv_cache_memory_gb=30.0), CPU)
    assert "more than the 20.0 GB available after the weights: the machine may swap" in kiln_log.text


def test_the_fraction_sizes_the_engine_and_is_logged(tmp_path, twenty_gb_free, kiln_log) -> None:
    write_hf_model(tmp_path, "llama")
    llm = LLM(str(tmp_path), graph_mode="eager", block_size=16, kv_cache_memory_fraction=0.0001)
    # 2 MB over 2 layers of 2 KV heads x 16 dims (fp32 K and V: 256 bytes a token) in 16-token blocks
    assert llm.engine.pool.num_blocks == 2_000_000 // (2 * 16 * 256)
    assert "(--kv-cache-memory-fraction 0.0001 of the 20.0 GB available after the weights)" in kiln_log.text


def test_the_fraction_must_be_in_0_1() -> None:
    assert fraction("0.9") == 0.9
    for bad in ("0", "1.5", "half"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"fraction in \(0, 1\]"):
            fraction(bad)
