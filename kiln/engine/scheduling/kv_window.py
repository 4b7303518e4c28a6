"""Sliding-window KV blocks: which leading blocks of a sequence no future query reads, and how many stay live.

When every layer slides with the same window W (`ModelConfig.uniform_sliding_window`), the query at position p
sees the keys at p - W < j <= p. A sequence's next query is at `num_computed_tokens` and every later one is
further on, so block b (positions [b * bs, (b + 1) * bs)) is dead once (b + 1) * bs <= num_computed_tokens - W + 1.
The scheduler frees dead blocks and writes the null block in their entries, keeping every entry's index (a block
table maps logical block -> physical block), so a sequence holds a bounded number of live blocks however long it
grows. W = 0 (no window) releases nothing.

When sliding layers alternate with global ones (Gemma 2/3, `ModelConfig.hybrid_sliding_window`), the two kinds keep
their KV in separate blocks: the global layers' pool grows with each sequence, the sliding layers' pool (its own
block ids, table and slots; vLLM's hybrid KV cache groups) is released behind the window as above. It needs only
`window_pool_blocks`, so the memory a sliding layer would hold for a long sequence goes to the global layers.
"""

from __future__ import annotations


def num_dead_blocks(num_computed_tokens: int, window: int, block_size: int) -> int:
    """Leading blocks of a sequence that no query at or after position `num_computed_tokens` sees (0: no window)."""
    if not window:
        return 0
    return max(0, num_computed_tokens - window + 1) // block_size


def max_decode_blocks(window: int, block_size: int) -> int:
    """Most live blocks a sequence holds while it decodes (one new token a step) under `window` > 0: the blocks that
    the W positions p - W + 1 .. p touch, at most ceil((W - 1) / bs) + 1."""
    return -(-(window - 1) // block_size) + 1


def chunk_limit(num_computed_tokens: int, window: int, block_size: int, max_blocks: int) -> int:
    """Most new tokens one step may give a sequence so that it holds at most `max_blocks` live blocks; at least 1
    whenever `max_blocks` >= `max_decode_blocks` (its dead blocks are released before the step grows it)."""
    dead = num_dead_blocks(num_computed_tokens, window, block_size)
    return (max_blocks + dead) * block_size - num_computed_tokens


def window_pool_blocks(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Blocks a sliding layers' pool needs so that it never limits a step: each of `max_num_seqs` decoding sequences
    holds at most `max_decode_blocks` (plus one for its new token), and one step's new tokens at most
    ceil(`max_num_batched_tokens` / `block_size`) more."""
    per_sequence = max_decode_blocks(window, block_size) + 1
    return max_num_seqs * per_sequence + -(-max_num_batched_tokens // block_size)
