"""Paged KV cache bookkeeping: a pool of fixed-size blocks with reference counts, and the prefix cache over them.

Pure Python; the tensors the blocks index live in the model runner. Their cache has one block more, the null block
(id `num_blocks`, kiln.model.attention.null_block): the pool never hands it out, and a sliding-window sequence's
released entries hold it (kiln.engine.scheduling.kv_window), so `free` skips it.

With prefix caching (kiln.engine.scheduling.prefix_cache) a full block that was computed is registered under its key;
when its last reference goes it stays cached but evictable, in the free queue in least-recently-freed order. `allocate`
takes blocks from the front of that queue and evicts any cache entry they held; `match` finds a prompt's cached
prefix and `take` shares it. A block with references is never evicted.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Iterable

from kiln.engine.scheduling.prefix_cache import CachedBlock, Key
from kiln.errors import KilnError

logger = logging.getLogger("kiln")


class BlockPool:
    """Blocks are allocated with ref count 1, shared with `incref`/`take`, and return to the free queue at 0."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise KilnError(f"KV cache needs >= 1 block of >= 1 token (got {num_blocks} blocks of {block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front: next to hand out
        self._ref_counts = [0] * num_blocks
        self._entries: dict[int, CachedBlock] = {}  # block -> its prefix-cache entry
        self._by_key: dict[Key, int] = {}
        self._serials = itertools.count()

    @property
    def null_block(self) -> int:
        """The id of the cache's null block, which no sequence owns."""
        return self.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds: free, or cached and evictable."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (held or evictable)."""
        return len(self._entries)

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
        blocks = [self._free.popitem(last=False)[0] for _ in range(num_blocks)]
        for b in blocks:
            self._ref_counts[b] = 1
            self._evict(b)
        return blocks

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            if b == self.null_block:
                raise KilnError(f"block {b} is the null block and cannot be shared")
            if self._ref_counts[b] == 0:
                raise KilnError(f"block {b} is free and cannot be shared")
            self._ref_counts[b] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; null-block entries (released behind a sliding window) are skipped. A
        block freed last goes to the back of the queue: free a sequence's blocks last first, so its tail is evicted
        before the prefix others may share."""
        for b in blocks:
            if b == self.null_block:
                continue
            if self._ref_counts[b] <= 0:
                raise KilnError(f"block {b} freed twice")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free[b] = None

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    # -- the prefix cache ---------------------------------------------------------------------------------------
    def register(self, block: int, key: Key, tokens: tuple[int, ...], parent: str | int) -> int:
        """Cache `block`, just computed full with `tokens` after `parent`
        (kiln.engine.scheduling.prefix_cache.CachedBlock); returns the serial its successor records. A block whose key
        is cached already (the same prefix computed twice in one step) stays uncached and the existing entry's serial
        stands for it."""
        if (entry := self._entries.get(block)) is not None:
            return entry.serial
        if (held := self._by_key.get(key)) is not None:
            found = self._entries[held]
            if found.tokens == tokens and found.parent == parent:
                return found.serial
            return -1 - block  # a key collision: this block is not cached, and no entry has this serial
        entry = CachedBlock(key, tokens, parent, next(self._serials))
        self._entries[block] = entry
        self._by_key[key] = block
        return entry.serial

    def match(self, keys: list[Key], tokens: list[tuple[int, ...]], root: str) -> tuple[list[int], list[int]]:
        """The longest cached prefix of a sequence whose full blocks have `keys` and `tokens`: (blocks, serials).
        Each block must hold exactly those tokens after exactly the entry before it, so a key collision is a miss."""
        blocks: list[int] = []
        serials: list[int] = []
        parent: str | int = root
        for key, toks in zip(keys, tokens, strict=True):
            block = self._by_key.get(key)
            entry = self._entries.get(block) if block is not None else None
            if entry is None or entry.tokens != toks or entry.parent != parent:
                break
            blocks.append(block)
            serials.append(entry.serial)
            parent = entry.serial
        return blocks, serials

    def evictable(self, blocks: list[int]) -> int:
        """How many of `blocks` no sequence holds (taking them uses up free blocks)."""
        return sum(1 for b in blocks if self._ref_counts[b] == 0)

    def take(self, blocks: list[int]) -> None:
        """Share cached `blocks` (from `match`): one more reference each, out of the free queue if none held them."""
        for b in blocks:
            if self._ref_counts[b] == 0:
                del self._free[b]
            self._ref_counts[b] += 1

    def reset_prefix_cache(self) -> int:
        """Drop every evictable block's cache entry (held ones stay cached); returns how many were dropped."""
        dropped = [b for b in self._free if b in self._entries]
        for b in dropped:
            self._evict(b)
        return len(dropped)

    def _evict(self, block: int) -> None:
        if (entry := self._entries.pop(block, None)) is not None:
            del self._by_key[entry.key]
