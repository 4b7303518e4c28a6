"""`BlockGroup`: one KV block pool and the layers whose KV it holds, as the scheduler grows, trims and releases a
request's blocks in it (a model has one group, or two when sliding-window layers alternate with global ones)."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.engine.request import Request
from kiln.engine.scheduling.kv_cache import BlockPool
from kiln.engine.scheduling.kv_window import chunk_limit, max_decode_blocks


@dataclass(frozen=True)
class BlockGroup:
    """One block pool and the layers whose KV it holds: `window` > 0 when they slide with that window."""

    pool: BlockPool
    window: int
    index: int  # the request's block table for this pool (`Request.block_tables`)

    def needed(self, req: Request, num_tokens: int) -> int:
        """Blocks `req` must be given to hold `num_tokens` tokens."""
        return self.pool.blocks_for(num_tokens) - len(req.block_tables[self.index])

    def grow(self, req: Request, num_tokens: int) -> None:
        req.block_tables[self.index] += self.pool.allocate(max(0, self.needed(req, num_tokens)))

    def trim(self, req: Request, num_tokens: int) -> None:
        """Free the blocks past those holding `num_tokens` tokens (a verification's rejected draft tokens had them:
        never full nor registered in the prefix cache, and past every later step's sequence length until rewritten)."""
        blocks = req.block_tables[self.index]
        keep = self.pool.blocks_for(num_tokens)
        if len(blocks) > keep:
            self.pool.free(reversed(blocks[keep:]))
            del blocks[keep:]

    def release(self, req: Request) -> None:
        """Free `req`'s blocks, its last first: cached, its tail is evicted before the prefix others may share."""
        self.pool.free(reversed(req.block_tables[self.index]))
        req.block_tables[self.index] = []
        req.block_serials = []


def window_cap(groups: list[BlockGroup], req: Request, wanted: int) -> int:
    """Under a window, at most the new tokens that keep `req` within its sliding group's blocks (its dead ones
    released): a prompt or a recompute longer than the pool is prefilled in chunks when chunked prefill is on."""
    for g in groups:
        if g.window:
            wanted = min(wanted, chunk_limit(req.num_computed_tokens, g.window, g.pool.block_size, g.pool.num_blocks))
    return wanted


def blocks_short(groups: list[BlockGroup], num_tokens: int, chunked: bool) -> tuple[int, int] | None:
    """(blocks needed at once, blocks the pool has) for the first pool that cannot hold a request of `num_tokens`
    tokens, else None (it is admissible). A request holds all its blocks at once; in a sliding group with chunked
    prefill, only a decoding sequence's live blocks (`window_cap`)."""
    for g in groups:
        needed = g.pool.blocks_for(num_tokens)
        if g.window and chunked:
            needed = min(needed, max_decode_blocks(g.window, g.pool.block_size))
        if needed > g.pool.num_blocks:
            return needed, g.pool.num_blocks
    return None
