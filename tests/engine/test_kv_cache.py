"""The block pool alone: free list, ref counts, exhaustion, the null block."""

from __future__ import annotations

import pytest

from kiln.engine.scheduling.kv_cache import BlockPool
from kiln.errors import KilnError


def test_allocate_share_and_free() -> None:
    pool = BlockPool(num_blocks=4, block_size=16)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free_blocks == 1
    pool.incref(a[:2])
    assert [pool.ref_count(b) for b in a] == [2, 2, 1]
    pool.free(a)
    assert pool.num_free_blocks == 2  # the shared two are still held once
    pool.free(a[:2])
    assert pool.num_free_blocks == 4 and pool.usage == 0.0


def test_exhaustion_and_double_free_are_errors() -> None:
    pool = BlockPool(num_blocks=2, block_size=4)
    assert pool.blocks_for(9) == 3 and not pool.can_allocate(3)
    with pytest.raises(KilnError, match="asked for 3 blocks, 2 free"):
        pool.allocate(3)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(KilnError, match="freed twice"):
        pool.free(blocks)
    with pytest.raises(KilnError, match="is free and cannot be shared"):
        pool.incref(blocks)


def test_null_block_is_never_handed_out_and_free_skips_it() -> None:
    pool = BlockPool(num_blocks=3, block_size=4)
    assert pool.null_block == 3  # the cache's last block (kiln.model.attention.null_block)
    blocks = pool.allocate(3)
    assert pool.null_block not in blocks
    pool.free([pool.null_block, *blocks, pool.null_block])  # a sliding-window table: released entries are null
    assert pool.num_free_blocks == 3
    with pytest.raises(KilnError, match="null block and cannot be shared"):
        pool.incref([pool.null_block])
