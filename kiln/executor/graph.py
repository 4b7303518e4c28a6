"""`GraphExecutor`: graph mode behind the `Executor` interface, composed of its roles.

prepare = the kernel plan (static compile sizes, weight layout, one-row head and packed kernels, timed on this
machine and cached: kiln.kernels.plan) -> build (kiln.compile.build: trace + split) -> the full decode graph where
the mode has one (kiln.compile.full_graph) -> compile every piece through the compiled-piece store
(kiln.compile.store: memo, on-disk cache, verification), and again per static compile size -> capture per capture
size (kiln.compile.capturer, which returns each size's static inputs; they go to the dispatcher) -> the fusion
contract on the pieces' code and on the full decode graph's (kiln.compile.fusion_check: a required recipe fusion
group the code does not realise fails here) -> the compiled one-row logits head. `forward` is the dispatcher's
(kiln.compile.dispatch). Every stage is counted in `counters`.

The engine calls `prepare`, `forward`, `pad_to` and `compute_logits`. `set_piece_modes` and `set_full_mode` switch
modes, compiling and capturing what a mode needs. The debugger's controls (rewrites, launch hooks, trace level, the
full decode graph override) are a class of their own over this one: kiln.executor.controls.GraphControls.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln.compile.artifacts import write_artifacts
from kiln.compile.build import PiecewiseForward, build_graph
from kiln.compile.capturer import Capturer
from kiln.compile.compiler import make_compiler
from kiln.compile.dispatch import Dispatcher
from kiln.compile.full_graph import FullDecodeGraph
from kiln.compile.fusion import FusionReport, piece_code
from kiln.compile.fusion_check import check_fusion
from kiln.compile.modes import PieceMode, format_piece_modes
from kiln.compile.piece import Piece
from kiln.compile.store import CompiledPieceStore
from kiln.config import DEFAULT_ACTIVATIONS, GraphConfig
from kiln.distributed.ops import local_collectives
from kiln.errors import ConfigError
from kiln.executor.base import Executor
from kiln.graph_mode import GraphMode
from kiln.kernels.head import LogitsHead, RowScores
from kiln.kernels.plan import KernelPlan, plan_kernels
from kiln.kernels.product import CompiledProduct, product_graph
from kiln.model.forward_context import ModelInputs
from kiln.platforms import platform_of

logger = logging.getLogger("kiln")


class GraphExecutor(Executor):
    name = "graph"

    def __init__(
        self,
        config: GraphConfig,
        activations: str = DEFAULT_ACTIVATIONS,
        head_rows: int | None = None,
        second_form_gb: float | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.activations = activations  # of packed products (kiln.kernels.plan)
        self.head_rows = head_rows  # the most rows a step samples (None: no bound; kiln.kernels.plan)
        self.second_form_gb = second_form_gb  # the memory second forms of packed weights may take (kiln.kernels.plan)
        self.capture_sizes = sorted(config.capture_sizes)
        self.compiler = make_compiler(config.compiler)
        self.mode = GraphMode(config.mode)  # the one value every choice below reads
        if not self.mode.is_graph:
            raise ConfigError("graph mode eager runs the EagerExecutor, not the graph executor")
        self.full: FullDecodeGraph | None = None  # decode-only steps' full graph (mode.has_full_decode_graph)
        self.build_seconds = 0.0
        self.fusion: list[FusionReport] = []  # per recipe fusion group, checked once the pieces are compiled
        self.full_fusion: list[FusionReport] = []  # the same groups on the full decode graph's code (if any)
        self.plan = KernelPlan()

    # -- prepare -----------------------------------------------------------------------------------------
    def prepare(self, model: nn.Module, kv_caches: list[torch.Tensor]) -> None:
        start = time.perf_counter()
        self.model = model
        self.device = next(model.parameters()).device
        cache_root = Path(self.config.cache_dir)
        # NOTE: attention reads Python-side metadata, so it cannot live inside a recorded graph.
        self.can_capture = self.mode.splits_forward or not platform_of(self.device).records_graphs
        self._plan_kernels(model, kv_caches, cache_root)
        # NOTE: at least 3: a packed model traced at 2 tokens specialises num_tokens (dynamo constraint violation)
        sample = max(3, min(self.capture_sizes[-1] if self.capture_sizes else 8, 8))
        self.graph: PiecewiseForward = build_graph(
            model,
            kv_caches,
            self.device,
            splitting_ops=self.config.splitting_ops,
            split=self.mode.splits_forward,
            counters=self.counters,
            sample_size=sample,
        )
        self.capturer = Capturer(self.graph, kv_caches, self.device, self.counters)
        default = PieceMode(self.config.default_piece_mode)
        if self.mode.has_full_decode_graph and self.capture_sizes:
            self.full = self._full_decode_graph(model, kv_caches, sample)
        for piece in self.all_pieces:
            piece.set_trace_level(self.config.debug)  # NOTE: KILN_DEBUG is in it (kiln.engine.setup.resolve)
        if self.full is not None:
            self.full.set_mode(default, self.store, self.capturer.pool)
        if default is PieceMode.CAPTURED and not self.mode.captures_pieces:
            default = PieceMode.COMPILED  # full / full_decode_only: mixed steps run the pieces uncaptured
        self.dispatcher = Dispatcher(self.mode, self.graph, self.counters, self.full)
        modes = {i: default for i in range(len(self.pieces))}
        modes.update(self._checked_modes(dict(self.config.piece_modes)))
        self.set_piece_modes(modes)
        self.fusion = check_fusion([piece_code(p) for p in self.pieces], self.config)
        if self.full is not None:
            self.full_fusion = check_fusion(self.full.checked_code(), self.config, "the full decode graph")
        self.logits_head = LogitsHead(model, self.plan.head_t, self._compile_logits_head(model), self.plan.head_forms)
        self.build_seconds = time.perf_counter() - start
        self._log_ready()
        if self.config.dump_dir:
            write_artifacts(self, Path(self.config.dump_dir))

    def _plan_kernels(self, model: nn.Module, kv_caches: list[torch.Tensor], cache_root: Path) -> None:
        """The kernel plan (installed on `model`), its static compile sizes, and the compiled-piece store."""
        self.plan = plan_kernels(
            model,
            cache_root,
            compiler=self.compiler,
            capture_sizes=self.capture_sizes,
            configured_sizes=self.config.compile_sizes,
            activations=self.activations,
            kv_caches=kv_caches,
            head_rows=self.head_rows,
            second_form_gb=self.second_form_gb,
        )
        self.plan.install(model)
        self.compile_sizes = self.plan.static_sizes
        self.store = CompiledPieceStore(
            self.compiler,
            cache_root,
            recipe_hash=self.config.recipe_hash,
            kv_caches=kv_caches,
            device=self.device,
            counters=self.counters,
        )

    def _full_decode_graph(self, model: nn.Module, kv_caches: list[torch.Tensor], sample: int) -> FullDecodeGraph:
        return FullDecodeGraph(
            model,
            kv_caches,
            self.device,
            counters=self.counters,
            sizes=self.capture_sizes,
            max_model_len=self.config.max_model_len,
            sample_size=sample,
            gemv_sizes=tuple(self.compile_sizes),
            decode_kernel=self.plan.decode_kernel,
        )

    def _log_ready(self) -> None:
        logger.info(
            "Graph mode ready in %.2f s (%s): %d pieces (%d distinct), %d compiled, %d from cache, %d captures "
            "[%s]%s%s",
            self.build_seconds,
            self.mode.value,
            len(self.pieces),
            len({p.info.structure_key for p in self.pieces}),
            self.counters.pieces_compiled,
            self.counters.cache_hits,
            self.counters.pieces_captured,
            format_piece_modes(self.piece_modes),
            self._static_summary(),
            self._full_summary(),
        )

    def _static_summary(self) -> str:
        if not self.compile_sizes:
            return ""
        c = self.counters
        sizes = list(self.compile_sizes)
        return f"; static sizes {sizes}: {c.static_compiles} compiled, {c.static_cache_hits} from cache"

    def _full_summary(self) -> str:
        if self.full is None:
            return ""
        how = "CUDA graphs" if self.full.piece.captures else f"{self.full.mode.value} on persistent buffers"
        return f"; full decode graph for sizes {self.full.sizes} ({how})"

    def set_full_mode(self, mode: PieceMode | str) -> None:
        """The full decode graph's mode (eager: its traced graph op by op), compiled and captured as that mode needs;
        no-op without one."""
        if self.full is not None:
            with local_collectives():  # as set_piece_modes
                self.full.set_mode(PieceMode(mode), self.store, self.capturer.pool)

    def _compile_logits_head(self, model: nn.Module) -> CompiledProduct | None:
        if not isinstance(model.lm_head, nn.Linear):
            return None  # a packed head runs its own timed kernels (kiln.kernels.packed)
        weight = model.lm_head.weight
        if 1 not in self.compile_sizes or not weight.is_contiguous():
            return None
        graph = product_graph(weight)
        key = f"logits_head:{list(weight.shape)}:{weight.dtype}"
        return CompiledProduct(self.store.get(graph, "the logits head", 1, key=key), graph, weight)

    # -- pieces and their modes --------------------------------------------------------------------------
    @property
    def pieces(self) -> list[Piece]:
        return self.graph.pieces

    @property
    def all_pieces(self) -> list[Piece]:
        """The pieces, then the full decode graph's (one per variant), if any."""
        return self.pieces + (self.full.pieces if self.full is not None else [])

    @property
    def splitting_submods(self) -> list[str]:
        return self.graph.splitting_submods

    @property
    def piece_modes(self) -> dict[int, PieceMode]:
        return {p.index: p.mode for p in self.pieces}

    def _checked_modes(self, modes: dict[int, Any]) -> dict[int, PieceMode]:
        checked = {}
        for idx, mode in modes.items():
            if not 0 <= idx < len(self.pieces):
                raise ConfigError(f"piece mode for piece {idx}: the graph has pieces 0..{len(self.pieces) - 1}")
            checked[idx] = PieceMode(mode)
        return checked

    def set_piece_modes(self, modes: dict[int, PieceMode | str]) -> None:
        """Switch pieces between eager, compiled and captured. Cheap once a piece has been compiled and captured:
        nothing is recompiled; what a piece never had is compiled (or loaded) and captured here, on each rank alone
        (kiln.distributed.ops: the ranks of a multi-device engine compile and capture at their own pace)."""
        with local_collectives():
            self._set_piece_modes(modes)

    def _set_piece_modes(self, modes: dict[int, PieceMode | str]) -> None:
        checked = self._checked_modes(modes)
        for idx, mode in checked.items():
            piece = self.pieces[idx]
            if mode is not PieceMode.EAGER and piece.compiled is None:
                piece.set_compiled(self._compile(piece))
            if mode is PieceMode.CAPTURED:
                for size in self.compile_sizes:
                    if size not in piece.static_compiled:
                        piece.set_compiled(self._compile(piece, size), static_size=size)
            piece.set_mode(mode)
        missing = [p for i, m in checked.items() if m is PieceMode.CAPTURED and not (p := self.pieces[i]).captures]
        if missing and self.capture_sizes and self.can_capture:
            self.dispatcher.add_static_inputs(self.capturer.capture(missing, self.capture_sizes))
        elif missing and not self.mode.splits_forward:
            logger.warning(
                "Full-graph mode on %s runs the compiled graph uncaptured: attention is not capturable",
                self.device.type,
            )

    def _compile(self, piece: Piece, static_size: int | None = None) -> Any:
        label = f"piece {piece.index} ({piece.describe()})"
        key = piece.info.structure_key if piece.persistent else None
        return self.store.get(piece.compile_source, label, static_size, persistent=piece.persistent, key=key)

    # -- run ---------------------------------------------------------------------------------------------
    @property
    def compile_seconds(self) -> dict[str, float]:
        return self.store.compile_seconds

    @property
    def cache_sources(self) -> dict[str, str]:
        return self.store.sources

    def pad_to(self, num_tokens: int) -> int:
        return self.dispatcher.pad_to(num_tokens)

    def forward(self, batch: ModelInputs) -> torch.Tensor:
        return self.dispatcher.run(batch)

    @property
    def kernel_choices(self) -> dict[str, dict[str, object]]:
        """What the kernel plan timed (or read from the cache) at prepare."""
        return self.plan.choices

    def score_rows(self, hidden: torch.Tensor, targets: torch.Tensor, timed_rows: int) -> RowScores | None:
        return self.logits_head.score_rows(hidden, targets, timed_rows)

    def compute_logits(self, hidden: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        """fp32 logits for `hidden[rows]` (kiln.kernels.head: one row the fastest way the plan found)."""
        return self.logits_head(hidden, rows)
