"""KV caches on transparent huge pages (kiln.huge_pages): the buffer is what `torch.zeros` gives, starts on a 2 MB
boundary where Linux offers THP, outlives the name it was made under, and the start-up line's count reads smaps."""

from __future__ import annotations

import gc

import pytest
import torch

from kiln import huge_pages
from kiln.config import ModelConfig
from kiln.huge_pages import HUGE_PAGE, huge_page_bytes, huge_pages_available, thp_mode, zeros
from kiln.model.attention import allocate_kv_caches

THP = huge_pages_available()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_zeros_is_a_zeroed_contiguous_tensor(dtype):
    shape = (2, 3, 700, 16, 64)  # 8.6 MB of float32, more than one huge page in every dtype here
    t = zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.storage_offset() == 0
    assert t._base is None  # a tensor of its own, as torch.zeros gives, not a view
    assert not t.any()
    if THP:
        assert t.data_ptr() % HUGE_PAGE == 0
    t[1, 2, 699, 15, 63] = 3
    t[0, 0, 0, 0, 0] = 5
    assert t.sum().item() == 8


def test_a_view_keeps_the_mapping_alive():
    t = zeros((4 * HUGE_PAGE // 4,), torch.float32)
    t.copy_(torch.arange(t.numel(), dtype=torch.float32))
    tail = t[-1000:]
    del t
    gc.collect()
    torch.zeros(HUGE_PAGE, dtype=torch.uint8).fill_(7)  # reuse freed memory, were the mapping gone
    assert torch.equal(tail, torch.arange(4 * HUGE_PAGE // 4 - 1000, 4 * HUGE_PAGE // 4, dtype=torch.float32))


@pytest.mark.parametrize(
    "text, mode", [("always [madvise] never\n", "madvise"), ("[always] madvise never\n", "always"), ("", "")]
)
def test_thp_mode_reads_the_bracketed_word(tmp_path, monkeypatch, text, mode):
    path = tmp_path / "enabled"
    path.write_text(text)
    monkeypatch.setattr(huge_pages, "THP_ENABLED", path)
    assert thp_mode() == mode


def test_without_thp_zeros_falls_back_to_torch(tmp_path, monkeypatch):
    monkeypatch.setattr(huge_pages, "THP_ENABLED", tmp_path / "missing")
    assert thp_mode() == "" and not huge_pages_available()
    t = zeros((3, HUGE_PAGE), torch.float32)
    assert t.shape == (3, HUGE_PAGE) and not t.any()


def test_a_refused_mapping_falls_back_to_torch(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(huge_pages.mmap, "mmap", refuse)
    t = zeros((3, HUGE_PAGE), torch.float32)
    assert t.shape == (3, HUGE_PAGE) and not t.any()


def test_huge_page_bytes_counts_the_mappings_that_hold_the_tensors(tmp_path, monkeypatch):
    t = torch.zeros(16)
    ptr = t.data_ptr()
    smaps = tmp_path / "smaps"
    smaps.write_text(
        f"{ptr - 4096:x}-{ptr + 8192:x} rw-p 00000000 00:00 0\n"
        "Size:               12 kB\n"
        "AnonHugePages:     4096 kB\n"
        "VmFlags: rd wr mr mw me ac hg\n"
        f"{ptr + 8192:x}-{ptr + 16384:x} rw-p 00000000 00:00 0\n"
        "AnonHugePages:     2048 kB\n"
        "not-an-address range\n"
        "AnonHugePages:     1024 kB\n"
    )
    monkeypatch.setattr(huge_pages, "SMAPS", smaps)
    assert huge_page_bytes([t, t[4:]]) == 4096 * 1024  # the others hold neither; the first counts once
    monkeypatch.setattr(huge_pages, "SMAPS", tmp_path / "missing")
    assert huge_page_bytes([t]) == 0


def test_kv_caches_start_on_huge_page_boundaries():
    config = ModelConfig(
        architecture="llama",
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    )
    caches = allocate_kv_caches(config, num_blocks=1100, block_size=16, dtype=torch.float32, device="cpu")
    assert all(not c.any() for c in caches)
    if THP:
        assert all(c.data_ptr() % HUGE_PAGE == 0 for c in caches)
