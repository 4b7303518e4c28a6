"""The compiled grammars of one engine, bounded in bytes, and the constraints that could not be compiled.

A compiled grammar's memory is llguidance's (its lexer's states, its parser's tables), which Python cannot measure,
so it is estimated from the grammar's text: on the default model's vocabulary a 0.47 MB enum schema grew the
process by ~10 MB once its first mask was computed (BYTES_PER_GRAMMAR_CHAR), and that memory was reused after its
eviction (the process stayed flat over 20 such schemas with 3 kept). The least recently used grammars are evicted
until the estimate fits the budget.

Failures are remembered by the constraint's key (a SHA-256 of its kind and text, never the text itself), so a
constraint that failed (or ran past the server's compile deadline) is refused at once when it comes again.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Any

MIB = 1 << 20
GRAMMAR_CACHE_BYTES = 256 * MIB
BYTES_PER_GRAMMAR_CHAR = 24  # measured: see the module docstring
BYTES_PER_GRAMMAR = 256 * 1024  # a small grammar's lexer and parser, whatever its text
NUM_FAILURES_KEPT = 4096  # keys and short messages: well under a megabyte


def grammar_key(kind: str, spec: str) -> str:
    """The cache key of a constraint: its kind and text, hashed (logs show its first 12 digits)."""
    return hashlib.sha256(f"{kind}\0{spec}".encode("utf-8", "surrogatepass")).hexdigest()


def estimated_bytes(grammar_text: str) -> int:
    """What a compiled grammar of this llguidance text is counted as against the cache's budget."""
    return BYTES_PER_GRAMMAR + BYTES_PER_GRAMMAR_CHAR * len(grammar_text)


class GrammarCache:
    """Compiled matchers by key within `max_bytes` (least recently used evicted first), and failures by key;
    thread-safe (the server's compile threads and the engine thread share it)."""

    def __init__(self, max_bytes: int = GRAMMAR_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.num_evicted = 0
        self._compiled: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self._failed: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._compiled)

    def get(self, key: str) -> Any | None:
        """The compiled matcher of `key`, now the most recently used; None when not cached."""
        with self._lock:
            if (entry := self._compiled.get(key)) is None:
                return None
            self._compiled.move_to_end(key)
            return entry[0]

    def put(self, key: str, matcher: Any, num_bytes: int) -> None:
        """Keep `matcher` as `key`'s, evicting the least recently used others until the budget holds it."""
        with self._lock:
            if key in self._compiled:
                return
            self._compiled[key] = (matcher, num_bytes)
            self.num_bytes += num_bytes
            while self.num_bytes > self.max_bytes and len(self._compiled) > 1:
                _, (_, freed) = self._compiled.popitem(last=False)
                self.num_bytes -= freed
                self.num_evicted += 1

    def failure(self, key: str) -> str | None:
        """Why `key`'s constraint could not be compiled, when it could not."""
        with self._lock:
            return self._failed.get(key)

    def fail(self, key: str, message: str) -> None:
        """Remember that `key`'s constraint failed (`message`: what its requests are told)."""
        with self._lock:
            self._failed[key] = message
            self._failed.move_to_end(key)
            while len(self._failed) > NUM_FAILURES_KEPT:
                self._failed.popitem(last=False)
