"""The scheduler's side of prefix caching: a waiting request takes its longest cached prefix, and the choices of one
`n > 1` request share their prompt.

A request admitted with its first `k` full blocks cached holds them (one more reference each) and prefills only the
rest; a prompt whose blocks are all cached still recomputes its last token, which is what yields the first output
token's logits, so at most `(num_tokens - 1) // block_size` blocks are taken.

Parallel sampling: while one choice of a client request prefills, its siblings with the same prompt wait; then each
takes the prompt's full blocks from the cache and a copy of the first choice's partial last block (copy on write:
the copy is made in the step's KV caches before its forward, kiln.engine.running.model_runner), and recomputes only the
prompt's last token with its own sampling. `n = 4` prefills the prompt once.

A request asking for prompt logprobs, or an embedding, reads nothing from the cache (each prompt row's logits or
hidden state come from its own forward), but registers the blocks it computes as any other does.

Full blocks are registered after the step that computed them (`register`, from `Scheduler.advance`), never before,
so a failed step leaves nothing cached.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from kiln.config import CacheConfig, ModelConfig
from kiln.engine.request import Request
from kiln.engine.scheduling.kv_cache import BlockPool
from kiln.engine.scheduling.prefix_cache import KEY_FUNCTIONS, Key, PrefixCacheStats, PrefixKeys

logger = logging.getLogger("kiln")


@dataclass
class CachedPrefix:
    """What a waiting request finds: cached blocks (with their serials), the tokens it need not compute, and the
    sibling's block to copy as its next one (None: no copy)."""

    blocks: list[int] = field(default_factory=list)
    serials: list[int] = field(default_factory=list)
    start: int = 0
    copy_from: int | None = None


NOTHING_CACHED = CachedPrefix()


class PrefixSharing:
    def __init__(self, pool: BlockPool, keys: PrefixKeys, fork: bool = True) -> None:
        """`fork`: siblings copy the first choice's partial block (off when steps are in flight on a pipeline: the
        block's last write may not have run yet)."""
        self.pool = pool
        self.keys = keys
        self.fork = fork
        self.stats = PrefixCacheStats()
        # key -> the running request computing that block (full blocks of prompts being prefilled, not cached yet)
        self.computing: dict[Key, str] = {}

    def waits(self, req: Request, running: Iterable[Request]) -> bool:
        """`req` would compute a block that a running request is computing now (its next uncached one), or is a
        choice whose sibling still prefills the same prompt: it waits to share them rather than computing them
        alongside (32 prompts with one system prompt compute it once)."""
        if req.block_ids or req.needs_prompt_logprobs or req.params.embed:
            return False
        if req.group is not None and not req.output_token_ids:
            last = req.num_prompt_tokens - 1
            if any(s.group == req.group and s.num_computed_tokens < last and _same_prompt(s, req) for s in running):
                return True
        if not self.computing:
            return False
        found = self.lookup(req, ())
        keys = req.block_keys
        return len(found.blocks) < len(keys) and keys[len(found.blocks)] in self.computing

    def lookup(self, req: Request, running: Iterable[Request]) -> CachedPrefix:
        """`req`'s cached prefix (it holds no blocks yet): never its last token, which is recomputed. A request that
        still needs prompt logprobs, or an embedding, takes none: every prompt row is scored or pooled from its own
        forward (vLLM's rule too; the blocks it computes still fill the cache)."""
        if req.block_ids or req.needs_prompt_logprobs or req.params.embed:
            return NOTHING_CACHED
        bs = self.pool.block_size
        n = (req.num_tokens - 1) // bs
        keys = self.keys.extend(req, n, bs)[:n]
        tokens = req.all_token_ids
        chunks = [tuple(tokens[i * bs : (i + 1) * bs]) for i in range(n)]
        blocks, serials = self.pool.match(keys, chunks, self.keys.root(req))
        found = CachedPrefix(blocks, serials, len(blocks) * bs)
        last = req.num_tokens - 1
        if self.fork and len(blocks) == n and last % bs and req.group is not None and not req.output_token_ids:
            for s in running:
                ready = s.group == req.group and s.num_computed_tokens >= last and _same_prompt(s, req)
                if ready and s.block_ids[:n] == blocks:
                    found.copy_from, found.start = s.block_ids[n], last
                    break
        return found

    def blocks_needed(self, found: CachedPrefix, num_tokens: int) -> int:
        """Free blocks admitting a request with `found` to `num_tokens` tokens uses: new ones and evictable hits."""
        return self.pool.blocks_for(num_tokens) - len(found.blocks) + self.pool.evictable(found.blocks)

    def admit(self, req: Request, found: CachedPrefix) -> tuple[int, int] | None:
        """Give `req` its cached prefix (counted in the stats); returns the (source, copy) block pair to copy."""
        self.stats.queries += req.num_tokens
        self.stats.hits += found.start
        self.pool.take(found.blocks)
        req.block_ids = list(found.blocks)
        req.block_serials = list(found.serials)
        req.num_computed_tokens = found.start
        if req.num_cached_tokens is None:  # a preempted request readmitted keeps its first count, as vLLM
            req.num_cached_tokens = found.start
        for key in req.block_keys[len(found.blocks) : req.num_prompt_tokens // self.pool.block_size]:
            self.computing.setdefault(key, req.request_id)
        if found.copy_from is None:
            return None
        copy = self.pool.allocate(1)[0]
        req.block_ids.append(copy)
        return found.copy_from, copy

    def register(self, req: Request) -> None:
        """Cache the blocks of `req` that its computed tokens have filled since the last call."""
        bs = self.pool.block_size
        full = req.num_computed_tokens // bs
        done = len(req.block_serials)
        if full <= done:
            return
        keys = self.keys.extend(req, full, bs)
        tokens = req.all_token_ids
        for i in range(done, full):
            parent = req.block_serials[i - 1] if i else self.keys.root(req)
            block_tokens = tuple(tokens[i * bs : (i + 1) * bs])
            req.block_serials.append(self.pool.register(req.block_ids[i], keys[i], block_tokens, parent))
            if self.computing.get(keys[i]) == req.request_id:
                del self.computing[keys[i]]

    def forget(self, req: Request) -> None:
        """`req` released its blocks (finished, aborted, preempted): it computes none of them any more."""
        for key in req.block_keys:
            if self.computing.get(key) == req.request_id:
                del self.computing[key]

    def reset(self) -> int:
        """Drop every evictable block from the cache; returns how many."""
        self.stats.resets += 1
        return self.pool.reset_prefix_cache()


def _same_prompt(a: Request, b: Request) -> bool:
    return a is not b and a.prompt_token_ids == b.prompt_token_ids and a.params.cache_salt == b.params.cache_salt


def cache_namespace(model: str, quantization: str, activations: str, kv_cache_dtype: str) -> str:
    """The root every block key of an engine chains from (kiln.engine.scheduling.prefix_cache.cache_root): a block
    computed with another checkpoint, weight quantization, activation arithmetic or KV cache dtype is never matched (a
    bfloat16 block read as int8 codes and scales would be garbage, and a rounder format's K/V are not the same
    prefix)."""
    return f"{model}|{quantization}|{activations}|{kv_cache_dtype}"


def prefix_keys_for(cc: CacheConfig, mc: ModelConfig, namespace: str) -> PrefixKeys | None:
    """How the engine keys its blocks (None: prefix caching off), logged in one start-up line."""
    if not cc.enable_prefix_caching:
        logger.info("Prefix caching: off (--no-enable-prefix-caching or the recipe's kv_cache.prefix_caching)")
        return None
    if window := mc.uniform_sliding_window or mc.hybrid_sliding_window:
        logger.info(
            "Prefix caching: off: the model's layers slide (window %d), so blocks behind the window are released "
            "and a prefix cannot be kept",
            window,
        )
        return None
    logger.info(
        "Prefix caching: on (%s block keys): full %d-token blocks are kept after their request and shared",
        cc.prefix_caching_hash_algo,
        cc.block_size,
    )
    return PrefixKeys(namespace, KEY_FUNCTIONS[cc.prefix_caching_hash_algo])
