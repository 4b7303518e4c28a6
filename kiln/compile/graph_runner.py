"""GraphRunner: the model runner's `forward_fn` in graph mode, owning padding to capture sizes.

Build = trace (dynamo, num_tokens symbolic) -> split at the splitting ops -> compile each distinct piece
once (on-disk cache) -> capture every piece per capture size, largest first. A step pads the batch to the
nearest capture size (attention ignores padding) and replays; above the largest size it runs the dynamic
compiled pieces. Every stage is counted in `counters`.
"""

from __future__ import annotations

import bisect
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from tqdm import tqdm

from kiln.compile.backend import INPUT_IDS, NUM_TOKENS, POSITIONS, padding_context, trace_forward
from kiln.compile.cache import CompileCache, make_key
from kiln.compile.capture import available_memory_gb, make_capture, new_pool
from kiln.compile.compiler import CompiledPiece, make_compiler
from kiln.compile.counters import CompileCounters
from kiln.compile.modes import PieceMode, format_piece_modes
from kiln.compile.piece import Piece
from kiln.compile.split import PieceGraph, module_paths, split_graph, structure_key
from kiln.compile.verify import check_against_graph
from kiln.config import GraphConfig
from kiln.env import read_env
from kiln.errors import ConfigError
from kiln.model.forward_context import get_forward_context, set_forward_context

if TYPE_CHECKING:
    from kiln.engine.model_runner import ModelRunner

logger = logging.getLogger("kiln")


class GraphRunner:
    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], config: GraphConfig) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.config = config
        self.device = next(model.parameters()).device
        self.counters = CompileCounters()
        self.capture_sizes = sorted(config.capture_sizes)
        self.max_capture_size = self.capture_sizes[-1] if self.capture_sizes else 0
        self.compiler = make_compiler(config.compiler)
        cache_root = Path(config.cache_dir) if config.cache_dir else read_env().cache_dir
        self.cache = CompileCache(cache_root, self.counters) if self.compiler.has_artifact else None
        self.compile_seconds: dict[str, float] = {}  # structure key -> compile (or cache load) time
        self.cache_sources: dict[str, str] = {}  # structure key -> "compiled" | "cache"
        self._compiled: dict[str, CompiledPiece] = {}
        self._static_inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._padded_sizes: list[int] = []
        self._pool = new_pool(self.device)
        self.is_full_graph = config.full_graph or not config.piecewise
        # NOTE: attention reads Python-side metadata, so it cannot live inside a CUDA graph.
        self.can_capture_full = self.device.type != "cuda"
        self.build_seconds = 0.0
        self._build()

    # -- build ------------------------------------------------------------------------------------------
    def _build(self) -> None:
        start = time.perf_counter()
        sample = max(2, min(self.max_capture_size or 8, 8))
        traced = trace_forward(self.model, self.model, self.kv_caches, self.device, sample)
        self.traced = traced
        self.counters.graphs_traced += 1
        if self.is_full_graph:
            gm = traced.gm
            info = PieceGraph(0, "", gm, structure_key(gm), module_paths(gm))
            self.pieces = [Piece(info, self.counters)]
            self.outer: nn.Module = self.pieces[0]
            self.splitting_submods: list[str] = []
        else:
            try:
                split = split_graph(traced.gm, tuple(self.config.splitting_ops))
            except ValueError as exc:
                raise ConfigError(f"cannot split the forward for piecewise graph mode: {exc}") from None
            self.pieces = [Piece(info, self.counters) for info in split.pieces]
            for piece in self.pieces:
                setattr(split.split_gm, piece.info.submod_name, piece)
            self.outer = split.split_gm
            self.splitting_submods = split.splitting_submods
        self.counters.pieces_seen = len(self.pieces)
        self.counters.splitting_ops_seen = len(self.splitting_submods)
        debug = max(read_env().debug, self.config.debug)
        for piece in self.pieces:
            piece.debug = debug
        self._args = list(traced.bound)
        self._slot_index = {
            slot: [i for i, s in enumerate(traced.slots) if s == slot] for slot in set(traced.slots) if slot
        }
        modes = {i: PieceMode.CAPTURED for i in range(len(self.pieces))}
        modes.update(self._checked_modes(dict(self.config.piece_modes)))
        self.set_piece_modes(modes)
        self.build_seconds = time.perf_counter() - start
        logger.info(
            "Graph mode ready in %.2f s: %d pieces (%d distinct), %d compiled, %d from cache, %d captures [%s]",
            self.build_seconds,
            len(self.pieces),
            len({p.info.structure_key for p in self.pieces}),
            self.counters.pieces_compiled,
            self.counters.cache_hits,
            self.counters.pieces_captured,
            format_piece_modes(self.piece_modes),
        )
        if self.config.dump_dir:
            from kiln.compile.artifacts import write_artifacts

            write_artifacts(self, Path(self.config.dump_dir))

    def _checked_modes(self, modes: dict[int, Any]) -> dict[int, PieceMode]:
        checked = {}
        for idx, mode in modes.items():
            if not 0 <= idx < len(self.pieces):
                raise ConfigError(f"piece mode for piece {idx}: the graph has pieces 0..{len(self.pieces) - 1}")
            checked[idx] = PieceMode(mode)
        return checked

    @property
    def piece_modes(self) -> dict[int, PieceMode]:
        return {p.index: p.mode for p in self.pieces}

    def set_piece_modes(self, modes: dict[int, PieceMode | str]) -> None:
        """Switch pieces between eager, compiled and captured. Cheap once a piece has been compiled and captured:
        nothing is recompiled; what a piece never had is compiled (or loaded) and captured here."""
        checked = self._checked_modes(modes)
        for idx, mode in checked.items():
            piece = self.pieces[idx]
            if mode is not PieceMode.EAGER and piece.compiled is None:
                piece.compiled = self._compile(piece)
            piece.mode = mode
        missing = [
            self.pieces[i] for i, m in checked.items() if m is PieceMode.CAPTURED and not self.pieces[i].captures
        ]
        if missing and self.capture_sizes and (not self.is_full_graph or self.can_capture_full):
            self._capture(missing)
        elif missing and self.is_full_graph:
            logger.warning(
                "Full-graph mode on %s runs the compiled graph uncaptured: attention is not capturable",
                self.device.type,
            )

    def _compile(self, piece: Piece) -> CompiledPiece:
        skey = piece.info.structure_key
        if skey in self._compiled:
            return self._compiled[skey]
        start = time.perf_counter()
        compiled = None
        key = None
        if self.cache is not None:
            key = make_key(skey, self.compiler.name, self.compiler.options(), self.config.recipe_hash, self.device)
            path = self.cache.lookup(key)
            if path is not None:
                try:
                    compiled = self.compiler.load(path, piece.graph)
                    with set_forward_context(padding_context(0, self.kv_caches, self.device)):
                        check_against_graph(compiled, piece.graph, self.device)
                except Exception as exc:  # any failure: the entry is not to be trusted
                    self.cache.reject(key, f"{type(exc).__name__}: {exc}")
                    compiled = None
                else:
                    self.counters.cache_hits += 1
                    self.cache_sources[skey] = "cache"
                    logger.info(
                        "Loaded piece %d (%s) from the compile cache %s in %.2f s",
                        piece.index,
                        piece.describe(),
                        path.parent,
                        time.perf_counter() - start,
                    )
        if compiled is None:
            compiled = self.compiler.compile(piece.graph)
            self.counters.pieces_compiled += 1
            self.cache_sources[skey] = "compiled"
            logger.info("Compiling a graph for dynamic shape takes %.2f s", time.perf_counter() - start)
            if self.cache is not None and key is not None:
                self.counters.cache_misses += 1
                self.cache.store(key, lambda p: self.compiler.save(compiled, p))
        self.compile_seconds[skey] = time.perf_counter() - start
        self._compiled[skey] = compiled
        return compiled

    def _capture(self, pieces: list[Piece]) -> None:
        """Capture `pieces` at every capture size, largest first, by running the forward on padding."""
        targets = set(map(id, pieces))
        for n in sorted(self.capture_sizes, reverse=True):
            ids, pos = self._static_inputs.setdefault(
                n,
                (
                    torch.zeros(n, dtype=torch.long, device=self.device),
                    torch.zeros(n, dtype=torch.long, device=self.device),
                ),
            )
            adopt = {id(ids), id(pos)}
            desc = f"Capturing num tokens (num_tokens={n} avail_mem={available_memory_gb(self.device):.2f} GB)"
            bar = tqdm(total=len(pieces), desc=desc, leave=False, delay=1.0)

            def hook(piece: Piece, args: tuple[Any, ...], n: int = n, adopt: set[int] = adopt, bar: tqdm = bar) -> Any:
                assert piece.compiled is not None
                capture = make_capture(self.device, piece.compiled.fn, args, piece.dynamic_args, adopt, self._pool)
                piece.captures[n] = capture
                adopt.update(id(o) for o in capture.outputs)
                self.counters.pieces_captured += 1
                bar.update(1)
                return capture.outputs

            for piece in self.pieces:
                piece.capture_hook = hook if id(piece) in targets else None
            try:
                with torch.inference_mode(), set_forward_context(padding_context(n, self.kv_caches, self.device)):
                    self.outer(*self._bind(ids, pos))
            finally:
                for piece in self.pieces:
                    piece.capture_hook = None
                bar.close()
            logger.info("%s: 100%%", desc)
        self._padded_sizes = sorted(self._static_inputs)

    # -- run --------------------------------------------------------------------------------------------
    def pad_to(self, num_tokens: int) -> int:
        """The smallest captured size >= num_tokens; num_tokens itself above the largest (or with no captures)."""
        sizes = self._padded_sizes
        i = bisect.bisect_left(sizes, num_tokens)
        return sizes[i] if i < len(sizes) else num_tokens

    def _bind(self, input_ids: torch.Tensor, positions: torch.Tensor) -> list[Any]:
        args = self._args
        for i in self._slot_index.get(INPUT_IDS, ()):
            args[i] = input_ids
        for i in self._slot_index.get(POSITIONS, ()):
            args[i] = positions
        n = input_ids.shape[0]
        for i in self._slot_index.get(NUM_TOKENS, ()):
            args[i] = n
        return args

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[0]
        meta = get_forward_context().attn_metadata
        self.counters.padding_tokens += n - meta.num_actual_tokens
        static = self._static_inputs.get(n)
        if static is not None and (not self.is_full_graph or meta.num_decodes == meta.num_seqs):
            self.counters.replays += 1
            ids, pos = static
            ids.copy_(input_ids)
            pos.copy_(positions)
            out = self.outer(*self._bind(ids, pos))
        else:
            self.counters.dynamic_fallbacks += 1
            args = self._bind(input_ids, positions)
            # a size without captures: every piece runs its compiled (or eager) graph for the dynamic shape
            out = self.pieces[0].run_dynamic(*args) if self.is_full_graph else self.outer(*args)
        return out[0]


def enable_graph_mode(runner: ModelRunner, config: GraphConfig) -> GraphRunner:
    """Build a GraphRunner for `runner`'s model and make it the runner's forward, padding and counters."""
    graph = GraphRunner(runner.model, runner.kv_caches, config)
    runner.forward_fn = graph
    runner.pad_to = graph.pad_to
    runner.counters = graph.counters
    runner.graph_runner = graph
    return graph
