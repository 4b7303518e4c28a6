"""A debug session: one model, engines that run it on each path, and taps recording every boundary.

A *path* is how one forward is executed: `eager` (the model's own forward), `eager-fp64` (a float64 copy of the
model, for the noise floor), `traced` (every graph piece eager: the traced FX graph run op by op), `compiled` or
`captured` (every piece in that mode); the graph paths take per-piece mode overrides. Every run is one greedy
request through `EngineCore.step` (the engine's own scheduler, batch layout, padding and capture sizes) for a
prefill and N decode steps, optionally teacher-forced (`forced_output`) so two paths see the same tokens.

The graph engine is built by `build_engine` like any other, with every piece eager (`default_piece_mode`);
the taps go in through the debugger's controls over the graph executor (kiln.executor.controls: `rebuild`,
`set_piece_hooks`) and the recorder is the engine's step observer. The eager paths are engines over the same
model (and its float64 copy) with an `EagerExecutor` that keeps the weight layout as it is.

With `lora` (`kiln debug diff --lora name=path`) every run is a request with that adapter: the eager engines share
the graph engine's adapter slots (the same model), the float64 copy gets a copy of them, so each path runs the
adapter and the diff holds graph mode to eager for it.

`--model` is a checkpoint (path or `default`), or `package.module:factory`, a Python callable returning a
Llama-family module (tests point the debugger at synthetic models this way; nothing is evaluated, the module is
imported and the callable called).
"""

from __future__ import annotations

import copy
import importlib
import logging
import re
from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn
from torch.fx import GraphModule

from kiln.compile.modes import PieceMode
from kiln.compile.piece import Piece
from kiln.config import EngineConfig
from kiln.debug.runs import DebugRuns, PathRun
from kiln.debug.taps import (
    Boundary,
    TapProbe,
    TapRecorder,
    eager_taps,
    locate_boundaries,
    model_boundaries,
    with_extra_outputs,
)
from kiln.debug.trace import trace_level
from kiln.distributed.state import rank_state
from kiln.engine.core import EngineCore
from kiln.engine.setup.args import EngineArgs
from kiln.engine.setup.build import apply_device_settings, build_core, build_engine
from kiln.engine.setup.resolve import resolve_engine_config
from kiln.errors import ConfigError
from kiln.executor.controls import GraphControls
from kiln.executor.eager import EagerExecutor
from kiln.executor.graph import GraphExecutor
from kiln.lora.request import LoRARequest
from kiln.model.dtypes import parse_dtype

logger = logging.getLogger("kiln")

_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
EAGER, EAGER_FP64, TRACED = "eager", "eager-fp64", "traced"
PATHS = (EAGER, EAGER_FP64, TRACED, "compiled", "captured")
DEBUG_SEED = 0  # a debug run is reproducible: a synthetic model's weights and a random prompt come from it
DEBUG_KV_CACHE_GB = 0.05  # each of the session's engines: ~1000 tokens of the default model


def is_factory_spec(model: str) -> bool:
    return bool(_FACTORY.match(model))


def load_factory(spec: str) -> nn.Module:
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--model {spec}: cannot import {attr} from {module_name} ({exc})") from None
    model = factory()
    if not isinstance(model, nn.Module) or not hasattr(model, "compute_logits"):
        raise ConfigError(f"--model {spec}: {attr}() returned {type(model).__name__}, expected a Llama-family module")
    return model


def debug_engine_args(args: EngineArgs, prefix_caching: bool = False) -> EngineArgs:
    """The session's engine arguments: graph mode (never eager: the session bisects pieces) with every piece eager
    until a path asks for more, one sequence at a time, a small KV cache (unless the blocks are given), a fixed
    seed by default, and no prefix caching (unless a run primes a cached prefix: kiln.debug.runs), so every path
    prefills the same tokens and their steps compare. With speculative decoding, its verification steps run with
    the forced tokens as drafts, whatever the method. The KV cache holds the model's own dtype unless a dtype (or a
    recipe) names one: a narrower cache's rounding would sit far above the float64 noise floor and hide a fault."""
    kv_cache_dtype = args.dtype if args.kv_cache_dtype == "auto" and args.recipe is None else args.kv_cache_dtype
    return replace(
        args,
        seed=args.seed if args.seed is not None else DEBUG_SEED,
        graph_mode=None if args.graph_mode == "eager" else args.graph_mode,  # the recipe's or the default mode
        enforce_eager=False,
        default_piece_mode=PieceMode.EAGER.value,
        max_num_seqs=1,
        kv_cache_memory_gb=min(args.kv_cache_memory_gb or DEBUG_KV_CACHE_GB, DEBUG_KV_CACHE_GB),
        kv_cache_memory_fraction=None,
        enable_prefix_caching=prefix_caching,
        kv_cache_dtype=kv_cache_dtype,
        # with speculation every debug run verifies teacher-forced drafts (kiln.debug.runs): no draft model
        speculative_method="ngram" if args.speculative_method else None,
        speculative_model=None,
    )


class DebugSession:
    def __init__(
        self,
        engine: EngineCore,
        args: EngineArgs,
        recorder: TapRecorder,
        cached_prefix: int = 0,
        lora: LoRARequest | None = None,
    ) -> None:
        graph = engine.executor
        if not isinstance(graph, GraphExecutor) or not graph.mode.splits_forward:
            raise ConfigError(
                "kiln debug needs the pieces (graph mode full_and_piecewise, piecewise or full_decode_only): "
                "the recipe or flags select graph mode full"
            )
        self.engine = engine
        self.model = engine.model
        self.graph: GraphExecutor = graph  # what was built, read-only
        self.controls = GraphControls(graph)  # every change to it
        self.args = args
        self.tokenizer = engine.tokenizer
        self.recipe = engine.recipe
        self.recorder = recorder
        self._eager_engines: dict[str, EngineCore] = {}
        self.runs = DebugRuns(recorder, cached_prefix, lora)
        self.fault_descriptions: list[str] = []
        self.base_keys = [p.info.structure_key for p in graph.pieces]
        try:
            located = locate_boundaries(graph.pieces, model_boundaries(self.model))
        except ValueError as exc:
            raise ConfigError(f"cannot place taps: {exc}") from None
        self.boundaries = [
            replace(b, piece=located[b.name][0]) if b.name in located else b for b in model_boundaries(self.model)
        ]
        self.tap_nodes = {name: node for name, (_, node) in located.items()}
        names = {p.index: [b.name for b in self.boundaries if b.piece == p.index] for p in graph.pieces}
        self.probes = [TapProbe(names[p.index], p.num_outputs, recorder) for p in graph.pieces]
        taps = {i: [self.tap_nodes[n] for n in mine] for i, mine in names.items() if mine}
        self.controls.rebuild(lambda p: with_extra_outputs(p.graph, taps[p.index]) if p.index in taps else None)
        for piece, probe in zip(graph.pieces, self.probes, strict=True):
            self.controls.set_piece_hooks(piece.index, after=probe)
        if graph.full is not None:  # decode steps run a full decode graph: the same taps, in each of them
            self.controls.rebuild_full(self._tap_full)
        self.controls.set_trace_level(trace_level(self.recipe))

    def _tap_full(self, full: Piece) -> GraphModule:
        located = locate_boundaries([full], model_boundaries(self.model))
        tapped = [b.name for b in self.boundaries if b.name in located]
        full.set_hooks(after=TapProbe(tapped, full.num_outputs, self.recorder))
        return with_extra_outputs(full.graph, [located[n][1] for n in tapped])

    # -- construction ----------------------------------------------------------------------------------------
    @classmethod
    def open(cls, args: EngineArgs, cached_prefix: int = 0, lora: LoRARequest | None = None) -> DebugSession:
        """Load the model and build its graph engine (traced once; every piece eager, nothing compiled); with
        `cached_prefix`, every run prefills over that many prompt tokens found in the prefix cache (DebugRuns); with
        `lora`, every run is a request with that adapter (LoRA turned on)."""
        recorder = TapRecorder()
        if lora is not None:
            args = replace(args, enable_lora=True)
        config = resolve_engine_config(debug_engine_args(args, cached_prefix > 0), refuse_inert_options=False)
        if config.parallel.is_distributed and rank_state() is None:
            raise ConfigError(
                "a multi-device debug session runs on every rank (kiln.debug.ranks): kiln debug diff and bisect "
                "start the ranks themselves"
            )
        if not is_factory_spec(args.model):
            engine = build_engine(config, observer=recorder)
            return cls(engine, args, recorder, cached_prefix=cached_prefix, lora=lora)
        if args.recipe:
            raise ConfigError("--recipe needs a checkpoint model: a recipe is validated against checkpoint headers")
        apply_device_settings(config)
        torch.manual_seed(config.seed)
        model = load_factory(args.model).to(device=args.device, dtype=parse_dtype(args.dtype))
        model.eval().requires_grad_(False)
        engine = build_core(config, model, checkpoint_path=args.model, observer=recorder)
        return cls(engine, args, recorder, cached_prefix=cached_prefix, lora=lora)

    # -- piece modes -------------------------------------------------------------------------------------------
    def set_modes(self, mode: PieceMode | str, overrides: dict[int, PieceMode] | None = None) -> dict[int, PieceMode]:
        """Every piece in `mode`, then `overrides`; compiles (tapped graphs) and captures what is missing."""
        modes: dict[int, PieceMode] = {p.index: PieceMode(mode) for p in self.graph.pieces}
        modes.update(overrides or {})
        self.controls.set_piece_modes(dict(modes))
        if self.graph.full is not None:
            # per-piece overrides localize a problem to pieces: decode steps then run the pieces too
            self.controls.use_full_decode_graph(not overrides)
            self.controls.set_full_mode(mode)
        return modes

    # -- runs --------------------------------------------------------------------------------------------------
    def run(
        self,
        path: str,
        prompt: Sequence[int],
        num_decode: int,
        forced: Sequence[int] | None = None,
        piece_modes: dict[int, PieceMode] | None = None,
    ) -> PathRun:
        """Prefill `prompt` then decode `num_decode` tokens on `path`, feeding `forced` tokens when given."""
        if path in (EAGER, EAGER_FP64):
            engine = self._eager_engine(path)
            with eager_taps(engine.model, self.boundaries, self.recorder):
                return self.runs.generate(path, engine, prompt, num_decode=num_decode, forced=forced)
        if path not in PATHS:
            raise ConfigError(f"unknown path {path!r}: expected one of {', '.join(PATHS)}")
        self.set_modes(PieceMode.EAGER if path == TRACED else path, piece_modes)
        return self.runs.generate(path, self.engine, prompt, num_decode=num_decode, forced=forced)

    def _eager_engine(self, path: str) -> EngineCore:
        """An engine over the session's model (or its float64 copy) running the model's own forward."""
        if path not in self._eager_engines:
            config: EngineConfig = self.engine.config
            model, lora = self.model, self.engine.lora  # the same model holds the same adapter slots
            if path == EAGER_FP64:
                model, lora = copy.deepcopy((self.model, self.engine.lora))  # the copy's slots with it
                model = model.to(torch.float64)
                config = replace(config, cache=replace(config.cache, dtype="auto"))
            engine = build_core(
                config,
                model,
                tokenizer=self.tokenizer,
                executor=EagerExecutor(config.graph.cache_dir, keep_layout=True),
                checkpoint_path=self.engine.checkpoint_path,
                observer=self.recorder,
                state=rank_state(),  # this rank's shard, in a debug command every rank runs
                lora=lora,
            )
            self._eager_engines[path] = engine
        return self._eager_engines[path]

    def boundary(self, name: str) -> Boundary:
        for b in self.boundaries:
            if b.name == name:
                return b
        raise ConfigError(f"no boundary {name!r}: expected one of {', '.join(b.name for b in self.boundaries)}")
