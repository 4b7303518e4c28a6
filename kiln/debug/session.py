"""A debug session: one model, its piecewise graph runner with taps installed, and runs of each path.

A *path* is how one forward is executed: `eager` (the model's own forward), `eager-fp64` (a float64 copy of the
model, for the noise floor), `traced` (every graph piece eager: the traced FX graph run op by op), `compiled` or
`captured` (every piece in that mode); the graph paths take per-piece mode overrides. Every run generates greedily
for a prefill and N decode steps through `ModelRunner.prepare` and `forward` — the engine's own batch layout,
padding and capture sizes — optionally teacher-forced to a given token sequence, so two paths see the same inputs.

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
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from kiln.compile.compiler import CompiledPiece
from kiln.compile.graph_runner import GraphRunner, enable_graph_mode
from kiln.compile.modes import PieceMode
from kiln.compile.split import structure_key
from kiln.config import SchedulerConfig
from kiln.debug.taps import (
    LOGITS,
    Boundary,
    TapProbe,
    TapRecorder,
    eager_taps,
    locate_boundaries,
    model_boundaries,
    with_extra_outputs,
)
from kiln.debug.trace import apply_trace_level
from kiln.engine.kv_cache import BlockPool
from kiln.engine.model_runner import ModelRunner
from kiln.engine.request import Request
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.scheduler import Scheduler
from kiln.errors import ConfigError

logger = logging.getLogger("kiln")

_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
EAGER, EAGER_FP64, TRACED = "eager", "eager-fp64", "traced"
PATHS = (EAGER, EAGER_FP64, TRACED, "compiled", "captured")
DEBUG_KV_BLOCKS = 64  # KV blocks of the session's own runners: 1024 tokens at block size 16


@dataclass(frozen=True)
class SessionOptions:
    model: str = "default"
    recipe: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    compiler: str | None = None
    capture_sizes: tuple[int, ...] | None = None
    cache_dir: str | None = None
    num_threads: int | None = None
    block_size: int = 16
    seed: int = 0


@dataclass
class PathRun:
    """What one path computed for one sequence: per step, each boundary's rows (real tokens only)."""

    path: str
    steps: list[dict[str, torch.Tensor]]
    tokens: list[int]  # the path's own greedy choice at every step
    input_ids: list[int]  # the tokens fed, flattened over steps
    positions: list[int]
    step_rows: list[int] = field(default_factory=list)  # tokens per step: the prompt, then 1 per decode

    def boundary(self, name: str) -> torch.Tensor:
        return torch.cat([s[name] for s in self.steps])


def _enable_eager_graph_mode(runner: ModelRunner, options: SessionOptions) -> GraphRunner:
    """Graph mode for `runner` with every piece eager: traced and split, nothing compiled or captured yet."""
    from kiln.compile.settings import graph_config_from

    config = graph_config_from(
        None,
        compiler=options.compiler,
        capture_sizes=options.capture_sizes,
        cache_dir=options.cache_dir,
        piece_modes={i: "eager" for i in range(len(runner.model.model.layers) + 1)},
    )
    return enable_graph_mode(runner, config)


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


class DebugSession:
    def __init__(
        self,
        model: nn.Module,
        runner: ModelRunner,
        options: SessionOptions,
        tokenizer: Any = None,
        recipe: Any = None,
    ) -> None:
        graph = runner.graph_runner
        if graph is None or graph.is_full_graph:
            raise ConfigError("kiln debug works on piecewise graph mode: the recipe or flags select full-graph mode")
        self.model = model
        self.runner = runner
        self.graph: GraphRunner = graph
        self.options = options
        self.tokenizer = tokenizer
        self.recipe = recipe
        self.recorder = TapRecorder()
        self._compiled: dict[tuple[str, int | None], CompiledPiece] = {}
        self._model64: nn.Module | None = None
        self.fault_descriptions: list[str] = []
        self.base_keys = [p.info.structure_key for p in graph.pieces]
        try:
            located = locate_boundaries(graph.pieces, model_boundaries(model))
        except ValueError as exc:
            raise ConfigError(f"cannot place taps: {exc}") from None
        self.boundaries = [
            replace(b, piece=located[b.name][0]) if b.name in located else b for b in model_boundaries(model)
        ]
        self.tap_nodes = {name: node for name, (_, node) in located.items()}
        self.probes: list[TapProbe] = []
        for piece in graph.pieces:
            mine = [b.name for b in self.boundaries if b.piece == piece.index]
            num_outputs = len(next(n for n in reversed(piece.graph.graph.nodes) if n.op == "output").args[0])
            probe = TapProbe(piece, mine, num_outputs, self.recorder)
            piece.graph = with_extra_outputs(piece.graph, [self.tap_nodes[name] for name in mine])
            piece.returns_tuple = True
            piece.compiled = None  # production code returns fewer outputs: compile the tapped graph on demand
            piece.static_compiled = {}
            piece.captures = {}
            setattr(graph.outer, piece.info.submod_name, probe)
            self.probes.append(probe)
        apply_trace_level(graph, recipe)

    # -- construction ----------------------------------------------------------------------------------------
    @classmethod
    def open(cls, options: SessionOptions) -> DebugSession:
        """Load the model and trace it once; every piece starts eager (nothing compiled or captured yet)."""
        if is_factory_spec(options.model):
            return cls._open_factory(options)
        from kiln.engine.llm import LLM

        # NOTE: a recipe may switch graph mode on, and the engine then builds it: every piece eager, so nothing is
        # compiled or captured before the taps are in. Without a recipe the session enables graph mode itself.
        graph_flags: dict[str, Any] = {}
        if options.recipe:
            from kiln.model.loader import read_checkpoint_header

            num_layers = read_checkpoint_header(options.model).config.num_layers
            graph_flags = {
                "enable_piecewise_graph": True,
                "compiler": options.compiler,
                "capture_sizes": options.capture_sizes,
                "piece_modes": f"0-{num_layers}:eager",
                "cache_dir": options.cache_dir,
            }
        llm = LLM(
            options.model,
            dtype=options.dtype,
            device=options.device,
            recipe=options.recipe,
            seed=options.seed,
            num_threads=options.num_threads,
            block_size=options.block_size,
            kv_cache_memory_gb=0.05,
            **graph_flags,
        )
        engine = llm.engine
        if engine.runner.graph_runner is None:
            _enable_eager_graph_mode(engine.runner, options)
        return cls(engine.model, engine.runner, options, engine.tokenizer, engine.recipe)

    @classmethod
    def _open_factory(cls, options: SessionOptions) -> DebugSession:
        from kiln.config import parse_dtype

        if options.recipe:
            raise ConfigError("--recipe needs a checkpoint model: a recipe is validated against checkpoint headers")
        if options.num_threads:
            torch.set_num_threads(options.num_threads)
        torch.manual_seed(options.seed)
        model = load_factory(options.model).to(device=options.device, dtype=parse_dtype(options.dtype))
        model.eval().requires_grad_(False)
        runner = ModelRunner(model, DEBUG_KV_BLOCKS, options.block_size, parse_dtype(options.dtype), ())
        _enable_eager_graph_mode(runner, options)
        return cls(model, runner, options)

    # -- piece modes -------------------------------------------------------------------------------------------
    def set_modes(self, mode: PieceMode | str, overrides: dict[int, PieceMode] | None = None) -> dict[int, PieceMode]:
        """Every piece in `mode`, then `overrides`; compiles (tapped graphs) and captures what is missing."""
        modes = {p.index: PieceMode(mode) for p in self.graph.pieces}
        modes.update(overrides or {})
        for idx, m in modes.items():
            piece = self.graph.pieces[idx]
            if m is not PieceMode.EAGER and piece.compiled is None:
                piece.compiled = self.compile_graph(piece.graph)
            if m is PieceMode.CAPTURED:
                for size in self.graph.compile_sizes:  # the static compiles captures of that size run
                    if size not in piece.static_compiled:
                        piece.static_compiled[size] = self.compile_graph(piece.graph, size)
        self.graph.set_piece_modes(dict(modes))
        return modes

    def compile_graph(self, graph: GraphModule, static_size: int | None = None) -> CompiledPiece:
        """Compile a (tapped) piece graph once per structure (and static size); never through the on-disk cache."""
        key = (structure_key(graph), static_size)
        if key not in self._compiled:
            self._compiled[key] = self.graph.compiler.compile(graph, static_size)
        return self._compiled[key]

    def recapture(self, piece_index: int) -> None:
        """Drop a piece's captures and capture it again if it runs captured (after its compiled code changed)."""
        piece = self.graph.pieces[piece_index]
        piece.captures = {}
        if piece.mode is PieceMode.CAPTURED:
            self.graph.set_piece_modes({piece_index: PieceMode.CAPTURED})

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
        if path == EAGER:
            runner = self._eager_runner(self.model)
            with eager_taps(self.model, self.boundaries, self.recorder):
                return self._generate(path, runner, prompt, num_decode, forced)
        if path == EAGER_FP64:
            model64 = self._fp64_model()
            with eager_taps(model64, self.boundaries, self.recorder):
                return self._generate(path, self._eager_runner(model64), prompt, num_decode, forced)
        if path not in PATHS:
            raise ConfigError(f"unknown path {path!r}: expected one of {', '.join(PATHS)}")
        self.set_modes(PieceMode.EAGER if path == TRACED else path, piece_modes)
        return self._generate(path, self.runner, prompt, num_decode, forced)

    def _eager_runner(self, model: nn.Module) -> ModelRunner:
        dtype = next(model.parameters()).dtype
        return ModelRunner(model, DEBUG_KV_BLOCKS, self.runner.block_size, dtype, ())

    def _fp64_model(self) -> nn.Module:
        if self._model64 is None:
            model64 = copy.deepcopy(self.model).to(torch.float64)
            if getattr(model64, "lm_head_t", None) is not None:
                model64.prepare_decode_head()  # the one-row head copy is a plain attribute: rebuild it in fp64
            self._model64 = model64
        return self._model64

    def _generate(
        self,
        path: str,
        runner: ModelRunner,
        prompt: Sequence[int],
        num_decode: int,
        forced: Sequence[int] | None,
    ) -> PathRun:
        num_blocks, block_size = runner.kv_caches[0].shape[1], runner.block_size
        pool = BlockPool(num_blocks, block_size)
        total = len(prompt) + num_decode + 1
        if pool.blocks_for(total) > num_blocks:
            raise ConfigError(
                f"the debug run needs {total} tokens of KV cache but the runner holds {num_blocks * block_size}; "
                "use a shorter prompt or fewer decode steps"
            )
        if forced is not None and len(forced) < num_decode:
            raise ConfigError(f"teacher forcing needs {num_decode} tokens, got {len(forced)}")
        scheduler = Scheduler(SchedulerConfig(1, max(len(prompt), 1), False), pool)
        params = SamplingParams(temperature=0.0, max_tokens=num_decode + 1, ignore_eos=True)
        req = Request("debug", None, list(prompt), params, None)
        scheduler.add(req)
        run = PathRun(path, [], [], [], [])
        self.recorder.take()
        try:
            for step in range(num_decode + 1):
                sched = scheduler.schedule()
                inputs = runner.prepare(sched)
                n = inputs.metadata.num_actual_tokens
                run.input_ids += inputs.input_ids[:n].tolist()
                run.positions += inputs.positions[:n].tolist()
                run.step_rows.append(n)
                with self.recorder.step(), torch.inference_mode():
                    hidden = runner.forward(inputs)
                    logits = runner.logits_fn(hidden)  # graph mode: the compiled one-row head too
                    self.recorder.record(LOGITS, logits, rows=1)
                token = int(logits[0].argmax())
                run.tokens.append(token)
                req.num_computed_tokens += sched.num_tokens
                req.output_token_ids.append(forced[step] if forced is not None and step < len(forced) else token)
        finally:
            scheduler.finish(req, "length")
            run.steps = self.recorder.take()
        return run

    def boundary(self, name: str) -> Boundary:
        for b in self.boundaries:
            if b.name == name:
                return b
        raise ConfigError(f"no boundary {name!r}: expected one of {', '.join(b.name for b in self.boundaries)}")
