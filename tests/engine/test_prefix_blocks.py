"""The prefix cache in the block pool alone: keys, exact matching, LRU eviction of evictable blocks only, the reset,
and the scheduler's admission with a cached prefix. Pure bookkeeping: no model runs."""

from __future__ import annotations

from kiln.config import SchedulerConfig
from kiln.engine.request import Request
from kiln.engine.sampling.sampling_params import SamplingParams
from kiln.engine.scheduling.kv_cache import BlockPool
from kiln.engine.scheduling.prefix_cache import PrefixKeys, builtin_key, cache_root, sha256_key
from kiln.engine.scheduling.prefix_sharing import cache_namespace
from kiln.engine.scheduling.scheduler import Scheduler

ROOT = cache_root("model|float32", None)


def cache_sequence(pool: BlockPool, tokens: list[int], key=sha256_key) -> tuple[list[int], list]:
    """Allocate and register a sequence's full blocks as if a step had computed them: (blocks, keys)."""
    bs = pool.block_size
    blocks = pool.allocate(len(tokens) // bs)
    keys, parent, prev = [], ROOT, ROOT
    for i, b in enumerate(blocks):
        chunk = tuple(tokens[i * bs : (i + 1) * bs])
        prev = key(prev, chunk)
        keys.append(prev)
        parent = pool.register(b, prev, chunk, parent)
    return blocks, keys


def chunks(tokens: list[int], bs: int) -> list[tuple[int, ...]]:
    return [tuple(tokens[i : i + bs]) for i in range(0, len(tokens) - len(tokens) % bs, bs)]


def test_a_cached_prefix_is_found_shared_and_kept_after_its_request() -> None:
    pool = BlockPool(8, 4)
    tokens = list(range(12))
    blocks, keys = cache_sequence(pool, tokens)
    pool.free(reversed(blocks))
    assert pool.num_free_blocks == 8 and pool.num_cached_blocks == 3  # evictable, still cached
    found, serials = pool.match(keys, chunks(tokens, 4), ROOT)
    assert found == blocks and len(set(serials)) == 3
    assert pool.evictable(found) == 3
    pool.take(found)
    assert [pool.ref_count(b) for b in blocks] == [1, 1, 1] and pool.num_free_blocks == 5
    other = [*tokens[:4], 99, 98, 97, 96]  # shares the first block only
    _, other_keys = cache_sequence(BlockPool(8, 4), other)
    assert pool.match(other_keys, chunks(other, 4), ROOT)[0] == blocks[:1]
    assert pool.match(keys, chunks(tokens, 4), cache_root("model|float32", "tenant-b"))[0] == []  # another salt


def test_colliding_keys_never_share_a_block() -> None:
    """With a key function where every block collides, sequences of other tokens still find nothing; sha256 tells
    the same two sequences apart by key already."""
    pool = BlockPool(8, 4)

    def collide(parent, toks):
        return 0

    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    blocks, _ = cache_sequence(pool, a, key=collide)
    assert pool.match([0], chunks(b, 4), ROOT)[0] == []  # same key, other tokens: a miss
    assert pool.match([0], chunks(a, 4), ROOT)[0] == blocks  # the right tokens still hit
    # a block whose key collides with a cached one of other tokens is left uncached, and so is what follows it
    (second,) = pool.allocate(1)
    assert pool.register(second, 0, tuple(b), ROOT) < 0 and pool.num_cached_blocks == 1
    assert sha256_key(ROOT, tuple(a)) != sha256_key(ROOT, tuple(b))
    assert builtin_key(ROOT, tuple(a)) == builtin_key(ROOT, tuple(a))


def test_a_block_cached_under_one_kv_dtype_is_never_served_to_another() -> None:
    """The KV cache dtype is part of the root every key chains from: the same tokens under another dtype have other
    keys, and even keys forced equal miss, since the first block must follow the asking engine's own root."""
    pool = BlockPool(4, 4)
    tokens = (1, 2, 3, 4)
    roots = {
        dtype: cache_root(cache_namespace("m.gguf", "packed", "int8x2", dtype), None) for dtype in ("int8", "bf16")
    }
    block = pool.allocate(1)
    pool.register(block[0], sha256_key(roots["int8"], tokens), tokens, roots["int8"])
    assert pool.match([sha256_key(roots["int8"], tokens)], [tokens], roots["int8"])[0] == block  # its own dtype hits
    assert pool.match([sha256_key(roots["bf16"], tokens)], [tokens], roots["bf16"]) == ([], [])
    assert pool.match([sha256_key(roots["int8"], tokens)], [tokens], roots["bf16"]) == ([], [])  # a forced collision


def test_eviction_takes_the_least_recently_freed_and_never_a_held_block() -> None:
    pool = BlockPool(4, 2)
    held, _ = cache_sequence(pool, [1, 2, 3, 4])  # 2 blocks, still held
    old, _ = cache_sequence(pool, [5, 6, 7, 8])
    pool.free(reversed(old))  # cached, evictable: the last block first in line
    assert pool.num_cached_blocks == 4
    assert pool.allocate(1) == [old[1]]  # a new block evicts the tail of the freed sequence first
    assert pool.num_cached_blocks == 3
    assert pool.allocate(1) == [old[0]]
    assert not pool.can_allocate(1)  # the held blocks are never handed out, cached or not
    assert all(pool.ref_count(b) == 1 for b in held) and pool.num_cached_blocks == 2


def test_reset_drops_evictable_blocks_only() -> None:
    pool = BlockPool(6, 2)
    held, keys = cache_sequence(pool, [1, 2, 3, 4])
    freed, _ = cache_sequence(pool, [5, 6, 7, 8])
    pool.free(freed)
    assert pool.reset_prefix_cache() == 2
    assert pool.num_cached_blocks == 2 and pool.match(keys, [(1, 2), (3, 4)], ROOT)[0] == held


def test_the_scheduler_admits_with_the_cached_prefix_and_recomputes_the_last_token() -> None:
    pool = BlockPool(16, 4)
    scheduler = Scheduler(SchedulerConfig(), pool, prefix_keys=PrefixKeys("model", sha256_key))
    params = SamplingParams(max_tokens=4, temperature=0)
    first = Request("a", None, list(range(1, 13)), params, None)  # 12 tokens: 3 full blocks
    scheduler.add(first)
    (s,) = scheduler.schedule().scheduled
    assert s.num_new_tokens == 12
    scheduler.advance(first, 12)
    first_blocks = list(first.block_ids)
    scheduler.finish(first, "stop")
    again = Request("b", None, list(range(1, 13)), params, None)
    scheduler.add(again)
    (s,) = scheduler.schedule().scheduled
    # every block is cached, but the last token yields the logits: its block is recomputed, the others shared
    assert again.block_ids[:2] == first_blocks[:2] and s.num_new_tokens == 4
    assert scheduler.prefix.stats.hits == 8 and scheduler.prefix.stats.queries == 24


def run_to_completion(scheduler: Scheduler) -> int:
    """Step until every request finished (one output token each, as if sampled); returns the tokens computed."""
    computed = 0
    while scheduler.has_unfinished:
        out = scheduler.schedule()
        assert out.scheduled, "a request waits for a block nobody computes"
        for s in out.scheduled:
            computed += s.num_new_tokens
            done = s.completes_sequence
            scheduler.advance(s.request, s.num_new_tokens)
            if done:
                scheduler.finish(s.request, "length")
    return computed


def test_concurrent_prompts_with_one_prefix_compute_it_once() -> None:
    """Eight prompts sharing 64 tokens arrive together: the first computes the prefix while the others wait for its
    blocks, then each computes only its own 4 tokens, in chunks or not."""
    for budget, threshold, unrelated in ((2048, 512, 4), (16, 16, 2)):
        pool = BlockPool(64, 4)
        config = SchedulerConfig(max_num_batched_tokens=budget, long_prefill_token_threshold=threshold)
        scheduler = Scheduler(config, pool, prefix_keys=PrefixKeys("model", sha256_key))
        prefix = list(range(100, 164))
        for i in range(8):
            scheduler.add(Request(f"r{i}", None, [*prefix, i, i, i, i], SamplingParams(max_tokens=1), None))
        assert run_to_completion(scheduler) == 68 + 7 * 4
        assert scheduler.prefix.computing == {} and pool.num_free_blocks == pool.num_blocks
        # unrelated prompts never wait on each other
        for i in range(4):
            scheduler.add(Request(f"u{i}", None, [200 + i] * 12, SamplingParams(max_tokens=1), None))
        # all four in one step, or, in 16-token steps, the first and a chunk of the second
        assert len(scheduler.schedule().scheduled) == unrelated
