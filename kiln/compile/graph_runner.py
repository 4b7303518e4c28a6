"""GraphRunner: the model runner's `forward_fn` in graph mode, owning padding to capture sizes.

Build = trace (dynamo, num_tokens symbolic) -> split at the splitting ops -> compile each distinct piece
once (on-disk cache), and again for each static compile size -> capture every piece per capture size,
largest first. A step pads the batch to the
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
from torch.fx import GraphModule
from tqdm import tqdm

from kiln.compile.backend import INPUT_IDS, NUM_TOKENS, POSITIONS, padding_context, trace_forward
from kiln.compile.cache import CompileCache, make_key
from kiln.compile.capture import available_memory_gb, make_capture, new_pool
from kiln.compile.compiler import CompiledPiece, make_compiler
from kiln.compile.counters import CompileCounters
from kiln.compile.modes import PieceMode, format_piece_modes
from kiln.compile.passes import GEMV_MAX_ROWS
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
        self._compiled: dict[tuple[str, int | None], CompiledPiece] = {}  # (structure, static size or None)
        self.compile_sizes = self._static_compile_sizes()
        self._static_inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._padded_sizes: list[int] = []
        self._pool = new_pool(self.device)
        self.is_full_graph = config.full_graph or not config.piecewise
        # NOTE: attention reads Python-side metadata, so it cannot live inside a CUDA graph.
        self.can_capture_full = self.device.type != "cuda"
        self.build_seconds = 0.0
        self._build()

    # -- build ------------------------------------------------------------------------------------------
    def _static_compile_sizes(self) -> tuple[int, ...]:
        """The configured compile sizes (checked by `graph_config_from`), or the automatic choice: on CPU with
        a compiler that has static variants, the capture sizes DecodeGemv serves."""
        sizes = self.config.compile_sizes
        if sizes is not None:
            return tuple(sorted(sizes))
        if self.device.type != "cpu" or not self.compiler.supports_static_sizes:
            return ()
        return tuple(s for s in self.capture_sizes if s <= GEMV_MAX_ROWS)

    def _build(self) -> None:
        start = time.perf_counter()
        if self.device.type == "cpu" and any(s <= GEMV_MAX_ROWS for s in self.compile_sizes):
            from kiln.model.registry import set_layer_weight_layout

            if set_layer_weight_layout(self.model, column_major=False):
                logger.info(
                    "Graph mode: decoder weights stored row-major; pieces for num_tokens in %s run GEMV "
                    "reductions over them",
                    [s for s in self.compile_sizes if s <= GEMV_MAX_ROWS],
                )
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
        self._build_logits_head()
        self.build_seconds = time.perf_counter() - start
        logger.info(
            "Graph mode ready in %.2f s: %d pieces (%d distinct), %d compiled, %d from cache, %d captures [%s]%s",
            self.build_seconds,
            len(self.pieces),
            len({p.info.structure_key for p in self.pieces}),
            self.counters.pieces_compiled,
            self.counters.cache_hits,
            self.counters.pieces_captured,
            format_piece_modes(self.piece_modes),
            self._static_summary(),
        )
        if self.config.dump_dir:
            from kiln.compile.artifacts import write_artifacts

            write_artifacts(self, Path(self.config.dump_dir))

    def _static_summary(self) -> str:
        if not self.compile_sizes:
            return ""
        c = self.counters
        return (
            f"; static sizes {list(self.compile_sizes)}: {c.static_compiles} compiled, {c.static_cache_hits} from cache"
        )

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
            if mode is PieceMode.CAPTURED:
                for size in self.compile_sizes:
                    if size not in piece.static_compiled:
                        piece.static_compiled[size] = self._compile(piece, size)
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

    def _compile(self, piece: Piece, static_size: int | None = None) -> CompiledPiece:
        label = f"piece {piece.index} ({piece.describe()})"
        return self._compile_graph(piece.graph, piece.info.structure_key, label, static_size)

    def _compile_graph(
        self, graph: GraphModule, skey: str, label: str, static_size: int | None = None
    ) -> CompiledPiece:
        """`graph` compiled for the dynamic num_tokens, or for `static_size` tokens; once per distinct
        structure (and size), from the on-disk cache when a verified entry exists."""
        memo = (skey, static_size)
        if memo in self._compiled:
            return self._compiled[memo]
        start = time.perf_counter()
        compiled = None
        key = None
        if self.cache is not None:
            options = self.compiler.options(static_size)
            key = make_key(skey, self.compiler.name, options, self.config.recipe_hash, self.device)
            path = self.cache.lookup(key)
            if path is not None:
                try:
                    compiled = self.compiler.load(path, graph)
                    with set_forward_context(padding_context(0, self.kv_caches, self.device)):
                        probe = {} if static_size is None else {"num_tokens": static_size}
                        check_against_graph(compiled, graph, self.device, **probe)
                except Exception as exc:  # any failure: the entry is not to be trusted
                    self.cache.reject(key, f"{type(exc).__name__}: {exc}")
                    compiled = None
                else:
                    if static_size is None:
                        self.counters.cache_hits += 1
                        self.cache_sources[skey] = "cache"
                    else:
                        self.counters.static_cache_hits += 1
                    size = "" if static_size is None else f" for num_tokens={static_size}"
                    logger.info(
                        "Loaded %s%s from the compile cache %s in %.2f s",
                        label,
                        size,
                        path.parent,
                        time.perf_counter() - start,
                    )
        if compiled is None:
            compiled = self.compiler.compile(graph, static_size)
            if static_size is None:
                self.counters.pieces_compiled += 1
                self.cache_sources[skey] = "compiled"
                logger.info("Compiling a graph for dynamic shape takes %.2f s", time.perf_counter() - start)
            else:
                self.counters.static_compiles += 1
                logger.info(
                    "Compiling a graph for static shape num_tokens=%d (%s) takes %.2f s",
                    static_size,
                    label,
                    time.perf_counter() - start,
                )
            if self.cache is not None and key is not None:
                if static_size is None:
                    self.counters.cache_misses += 1
                self.cache.store(key, lambda p: self.compiler.save(compiled, p))
        if static_size is None:
            self.compile_seconds[skey] = time.perf_counter() - start
        self._compiled[memo] = compiled
        return compiled

    def _build_logits_head(self) -> None:
        """One-row logits through the same GEMV reduction as the pieces (CPU, static size 1 compiled)."""
        self._head = None
        model = self.model
        if 1 not in self.compile_sizes or not hasattr(model, "lm_head"):
            return
        weight = model.lm_head.weight
        if not weight.is_contiguous():
            return
        graph = logits_head_graph(weight)
        skey = f"logits_head:{list(weight.shape)}:{weight.dtype}"
        self._head = self._compile_graph(graph, skey, "the logits head", static_size=1)
        self._head_weight = weight
        # dynamo orders a graph's inputs its own way (here the weight first): find it by its shape
        first = next(n for n in graph.graph.nodes if n.op == "placeholder")
        self._head_weight_first = tuple(first.meta["example_value"].shape) == tuple(weight.shape)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits for `hidden` rows: one row through the compiled GEMV head, more through the model."""
        if self._head is not None and hidden.shape[0] == 1:
            args = (self._head_weight, hidden) if self._head_weight_first else (hidden, self._head_weight)
            return self._head.fn(*args)[0]
        return self.model.compute_logits(hidden)

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
                compiled = piece.static_compiled.get(n, piece.compiled)
                assert compiled is not None
                capture = make_capture(self.device, compiled.fn, args, piece.dynamic_args, adopt, self._pool)
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


def _logits(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor]:
    return (torch.mm(hidden, weight.t()).float(),)


def logits_head_graph(weight: torch.Tensor) -> GraphModule:
    """The one-row logits product traced by dynamo (inputs: hidden [1, hidden_size] and the head weight)."""
    graphs: list[GraphModule] = []

    def grab(gm: GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(gm)
        return gm.forward

    hidden = torch.zeros(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
    with torch.inference_mode():
        torch.compile(_logits, backend=grab, fullgraph=True, dynamic=False)(hidden, weight)
    return graphs[0]


def enable_graph_mode(runner: ModelRunner, config: GraphConfig) -> GraphRunner:
    """Build a GraphRunner for `runner`'s model and make it the runner's forward, padding and counters."""
    graph = GraphRunner(runner.model, runner.kv_caches, config)
    runner.forward_fn = graph
    runner.pad_to = graph.pad_to
    runner.logits_fn = graph.compute_logits
    runner.counters = graph.counters
    runner.graph_runner = graph
    return graph
