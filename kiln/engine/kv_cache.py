"""Paged KV cache bookkeeping: a pool of fixed-size blocks with a free list and reference counts.

Pure Python; the tensors the blocks index live in the model runner. Their cache has one block more, the null block
(id `num_blocks`, kiln.model.attention.null_block): the pool never hands it out, and a sliding-window sequence's
released entries hold it (kiln.engine.kv_window), so `free` skips it.
"""

from __future__ import annotations

from collections import deque

from kiln.errors import KilnError


class BlockPool:
    """Blocks are allocated with ref count 1, shared with `incref`, and return to the free list at 0."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise KilnError(f"KV cache needs >= 1 block of >= 1 token (got {num_blocks} blocks of {block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def null_block(self) -> int:
        """The id of the cache's null block, which no sequence owns."""
        return self.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise KilnError(f"KV cache exhausted: asked for {num_blocks} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        for b in blocks:
            self._ref_counts[b] = 1
        return blocks

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            if b == self.null_block:
                raise KilnError(f"block {b} is the null block and cannot be shared")
            if self._ref_counts[b] == 0:
                raise KilnError(f"block {b} is free and cannot be shared")
            self._ref_counts[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; null-block entries (released behind a sliding window) are skipped."""
        for b in blocks:
            if b == self.null_block:
                continue
            if self._ref_counts[b] <= 0:
                raise KilnError(f"block {b} freed twice")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free.append(b)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]
