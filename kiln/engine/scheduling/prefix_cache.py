"""Automatic prefix caching: the keys that name a full KV block by everything before it, and the cache's counters.

A full block's key chains the key of the block before it (the first block's: the cache's root, which names the model,
the KV dtype, the request's `cache_salt` and its LoRA adapter) with the block's token ids, so equal keys mean equal
prefixes. The key only finds a candidate: `BlockPool.match` (kiln.engine.scheduling.kv_cache) then compares the
block's token ids and the exact cache entry it was computed after, so even two sequences whose keys collide never share
a block. sha256 is the default key (vLLM's too); `builtin` (Python's hash of a tuple) is cheaper and, thanks to that
check, still safe: a collision costs a miss, never a wrong block.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kiln.engine.request import Request

Key = Hashable
KeyFunction = Callable[[Key, tuple[int, ...]], Key]
HASH_ALGOS = ("sha256", "builtin")


def sha256_key(parent: Key, tokens: tuple[int, ...]) -> Key:
    """32 bytes of sha256 over the parent's key and the block's token ids (little-endian int64)."""
    h = hashlib.sha256(parent if isinstance(parent, bytes) else repr(parent).encode())
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()


def builtin_key(parent: Key, tokens: tuple[int, ...]) -> Key:
    """Python's 64-bit hash of (parent, tokens): fast, not collision resistant (match checks the tokens)."""
    return hash((parent, tokens))


KEY_FUNCTIONS: dict[str, KeyFunction] = {"sha256": sha256_key, "builtin": builtin_key}


def cache_root(namespace: str, salt: str | None, lora_id: int | None = None) -> str:
    """The parent of a sequence's first block: the engine's namespace (model, KV dtype), the request's salt and its
    LoRA adapter (two adapters compute different K/V for one prompt: they never share a block)."""
    adapter = f"\x00lora{lora_id}" if lora_id is not None else ""
    return f"{namespace}\x00{salt or ''}{adapter}"


@dataclass(frozen=True)
class CachedBlock:
    """A full block's cache entry: its key, its token ids and what it was computed after (the root of its
    sequence for a first block, else the serial of the entry before it). Serials are never reused."""

    key: Key
    tokens: tuple[int, ...]
    parent: str | int
    serial: int


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the cache and tokens found there, since the engine started (Prometheus counters
    and /health read them), and how often the cache was cleared."""

    queries: int = 0
    hits: int = 0
    resets: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"queries": self.queries, "hits": self.hits, "hit_rate": round(self.hit_rate, 4)}


@dataclass(frozen=True)
class PrefixKeys:
    """How one engine names its blocks: its namespace (model, KV dtype) and key function."""

    namespace: str
    key_function: KeyFunction

    def root(self, req: Request) -> str:
        return cache_root(self.namespace, req.params.cache_salt, req.lora_id)

    def extend(self, req: Request, num_blocks: int, block_size: int) -> list[Key]:
        """`req.block_keys` for at least its first `num_blocks` full blocks (each key is computed once)."""
        keys = req.block_keys
        if len(keys) < num_blocks:
            tokens = req.all_token_ids
            parent = keys[-1] if keys else self.root(req)
            for i in range(len(keys), num_blocks):
                parent = self.key_function(parent, tuple(tokens[i * block_size : (i + 1) * block_size]))
                keys.append(parent)
        return keys
