"""The compiled-piece store: every compile in graph mode goes through it (the executor, the debugger, faults).

`get(graph, label, static_size)` returns the graph compiled for the dynamic num_tokens (or for `static_size`
tokens), once per structure key: identical pieces share one compile. With `persistent=True` it first looks in
the on-disk cache and verifies a hit against the traced graph on a probe input before trusting it (a stale or
corrupt entry is rejected and rebuilt); a fresh compile is stored. Rewritten graphs (taps, faults) pass
`persistent=False`, so the cache only ever holds production graphs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.fx import GraphModule

from kiln.compile.backend import padding_context
from kiln.compile.cache import CacheKey, CompileCache, make_key
from kiln.compile.compiler import CompiledPiece, PieceCompiler
from kiln.compile.counters import CompileCounters
from kiln.compile.split import structure_key
from kiln.compile.verify import check_against_graph
from kiln.model.forward_context import set_forward_context

logger = logging.getLogger("kiln")


class CompiledPieceStore:
    def __init__(
        self,
        compiler: PieceCompiler,
        cache_root: Path,
        recipe_hash: str,
        kv_caches: list[torch.Tensor],
        device: torch.device,
        counters: CompileCounters,
    ) -> None:
        self.compiler = compiler
        self.counters = counters
        self.cache = CompileCache(cache_root, counters) if compiler.has_artifact else None
        self.recipe_hash = recipe_hash
        self.kv_caches = kv_caches
        self.device = device
        self.compile_seconds: dict[str, float] = {}  # structure key -> compile (or cache load) time
        self.sources: dict[str, str] = {}  # structure key -> "compiled" | "cache"
        self._memo: dict[tuple[str, int | None], CompiledPiece] = {}

    def get(
        self,
        graph: GraphModule,
        label: str,
        static_size: int | None = None,
        persistent: bool = True,
        key: str | None = None,
        probe: Callable[[], Sequence[Any]] | None = None,
    ) -> CompiledPiece:
        """`graph` compiled once per structure (`key`, default its structure key) and size. A cache hit is checked
        on a probe input: `probe()`'s arguments where given, else random ones made from the graph's inputs."""
        skey = key or structure_key(graph)
        memo = (skey, static_size)
        if memo not in self._memo:
            start = time.perf_counter()
            compiled = (
                self._load(graph=graph, skey=skey, label=label, static_size=static_size, probe=probe)
                if persistent
                else None
            )
            if compiled is None:
                compiled = self._compile(
                    graph=graph, skey=skey, label=label, static_size=static_size, persistent=persistent
                )
            if static_size is None:
                self.compile_seconds[skey] = time.perf_counter() - start
            self._memo[memo] = compiled
        return self._memo[memo]

    def _key(self, skey: str, static_size: int | None) -> CacheKey:
        """The cache key of a piece of structure `skey` compiled at `static_size` (None: the dynamic shape)."""
        return make_key(
            structure=skey,
            compiler=self.compiler.name,
            options=self.compiler.options(static_size),
            recipe_hash=self.recipe_hash,
            device=self.device,
        )

    def _load(
        self,
        graph: GraphModule,
        skey: str,
        label: str,
        static_size: int | None,
        probe: Callable[[], Sequence[Any]] | None,
    ) -> CompiledPiece | None:
        if self.cache is None:
            return None
        start = time.perf_counter()
        key = self._key(skey, static_size)
        path = self.cache.lookup(key)
        if path is None:
            return None
        try:
            compiled = self.compiler.load(path, graph)
            with set_forward_context(padding_context(0, self.kv_caches, self.device)):
                size = {} if static_size is None else {"num_tokens": static_size}
                check_against_graph(compiled.fn, graph, self.device, args=probe() if probe else None, **size)
        except Exception as exc:  # any failure: the entry is not to be trusted
            self.cache.reject(key, f"{type(exc).__name__}: {exc}")
            return None
        if static_size is None:
            self.counters.cache_hits += 1
            self.sources[skey] = "cache"
        else:
            self.counters.static_cache_hits += 1
        size = "" if static_size is None else f" for num_tokens={static_size}"
        logger.info(
            "Loaded %s%s from the compile cache %s in %.2f s", label, size, path.parent, time.perf_counter() - start
        )
        return compiled

    def _compile(
        self, graph: GraphModule, skey: str, label: str, static_size: int | None, persistent: bool
    ) -> CompiledPiece:
        start = time.perf_counter()
        compiled = self.compiler.compile(graph, static_size)
        elapsed = time.perf_counter() - start
        if static_size is None:
            self.counters.pieces_compiled += 1
            self.sources[skey] = "compiled"
            logger.info("Compiling a graph for dynamic shape takes %.2f s", elapsed)
        else:
            self.counters.static_compiles += 1
            logger.info(
                "Compiling a graph for static shape num_tokens=%d (%s) takes %.2f s", static_size, label, elapsed
            )
        if persistent and self.cache is not None:
            if static_size is None:
                self.counters.cache_misses += 1
            key = self._key(skey, static_size)
            self.cache.store(key, lambda p: self.compiler.save(compiled, p))
        return compiled
