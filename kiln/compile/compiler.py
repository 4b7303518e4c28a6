"""Piece compilers: one base class, one registry entry each (`inductor`, `eager`).

A compiler turns a piece's FX graph (dynamic `num_tokens`) into a callable with the graph's signature that
returns a sequence of tensors (the graph's outputs; one element when the graph returns a single tensor).
`save`/`load` move its artifact through the on-disk cache; a compiler without one (eager) has nothing to cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.fx import GraphModule

from kiln.compile.passes import KilnPostGradPasses
from kiln.compile.split import structure_key
from kiln.compile.verify import probe_inputs
from kiln.errors import ConfigError

PieceFn = Callable[..., Sequence[torch.Tensor]]


@dataclass
class CompiledPiece:
    fn: PieceFn
    source_code: str | None  # generated wrapper code (inductor), for kernel counts and fusion reports
    artifact: Any = None  # what `save` writes


class PieceCompiler(ABC):
    name: str
    has_artifact: bool = False

    supports_static_sizes: bool = False

    def options(self, static_size: int | None = None) -> dict[str, Any]:
        """Settings that change the generated code: part of the cache key."""
        return {}

    @abstractmethod
    def compile(self, graph: GraphModule, static_size: int | None = None) -> CompiledPiece:
        """Compile `graph` for its dynamic num_tokens, or specialised to `static_size` tokens when given
        (only compilers with `supports_static_sizes`)."""

    def save(self, compiled: CompiledPiece, path: Path) -> None:
        raise TypeError(f"the {self.name} compiler produces no artifact to cache (has_artifact is False)")

    def load(self, path: Path, graph: GraphModule) -> CompiledPiece:
        raise TypeError(f"the {self.name} compiler produces no artifact to cache (has_artifact is False)")


class EagerCompiler(PieceCompiler):
    """Runs the traced graph as is: zero compile cost (SGLang's `eager` compiler)."""

    name = "eager"

    def compile(self, graph: GraphModule, static_size: int | None = None) -> CompiledPiece:
        if static_size is not None:
            raise TypeError("the eager compiler runs the traced graph as is: it has no static-size variant")
        if not returns_tuple(graph):
            raise ValueError("piece graphs must return a tuple (Piece rewrites single outputs before compiling)")
        return CompiledPiece(graph.forward, None)


class InductorCompiler(PieceCompiler):
    """`torch._inductor.standalone_compile` for the graph's own symbolic shapes; artifacts are portable files."""

    name = "inductor"
    has_artifact = True
    supports_static_sizes = True

    def options(self, static_size: int | None = None) -> dict[str, Any]:
        # NOTE: no freezing / weight prepacking: parameters are graph inputs shared by identical pieces, and
        # on CPU the extern aten mm inductor emits is the same BLAS call eager makes (prepacked mkldnn
        # linear was slower for these small shapes). Size asserts cost a Python call per input per step.
        options: dict[str, Any] = {
            "size_asserts": False,
            "freezing": False,
            "max_autotune": False,
            "passes": KilnPostGradPasses().uuid(),
        }
        if static_size is not None:
            options["static_num_tokens"] = static_size
        return options

    def compile(self, graph: GraphModule, static_size: int | None = None) -> CompiledPiece:
        patches = {k: v for k, v in self.options().items() if k != "passes"}
        patches["post_grad_custom_post_pass"] = KilnPostGradPasses()
        if static_size is None:
            example_inputs = [n.meta["example_value"] for n in graph.graph.nodes if n.op == "placeholder"]
            dynamic_shapes = "from_graph"
        else:
            example_inputs = probe_inputs(graph, _graph_device(graph), static_size)
            dynamic_shapes = "from_example_inputs"
        with _new_generated_modules() as new_modules:
            artifact = torch._inductor.standalone_compile(
                graph, example_inputs, dynamic_shapes=dynamic_shapes, options={"config_patches": patches}
            )
        return CompiledPiece(artifact, _source(new_modules), artifact)

    def save(self, compiled: CompiledPiece, path: Path) -> None:
        compiled.artifact.save(path=str(path), format="binary")

    def load(self, path: Path, graph: GraphModule) -> CompiledPiece:
        # NOTE: inductor loads on first use (importing it takes ~1 s): an eager engine never pays for it.
        from torch._inductor import CompiledArtifact

        with _new_generated_modules() as new_modules:
            artifact = CompiledArtifact.load(path=str(path), format="binary")
        return CompiledPiece(artifact, _source(new_modules), artifact)


class CompileOnce(PieceCompiler):
    """`compiler`, compiling each graph structure (and static size) once: the packed kernel table builds the same
    small graph for many row counts and again for its winners (the structure key holds the input shapes and
    strides, so equal keys mean the same code)."""

    def __init__(self, compiler: PieceCompiler) -> None:
        self.inner = compiler
        self.name, self.has_artifact = compiler.name, compiler.has_artifact
        self.supports_static_sizes = compiler.supports_static_sizes
        self.compiled: dict[tuple[str, int | None], CompiledPiece] = {}
        self.memo: dict[Hashable, Any] = {}  # what callers built around these compiles, by a key of their own

    def options(self, static_size: int | None = None) -> dict[str, Any]:
        return self.inner.options(static_size)

    def compile(self, graph: GraphModule, static_size: int | None = None) -> CompiledPiece:
        key = (structure_key(graph), static_size)
        if key not in self.compiled:
            self.compiled[key] = self.inner.compile(graph, static_size)
        return self.compiled[key]


COMPILERS: dict[str, type[PieceCompiler]] = {cls.name: cls for cls in (InductorCompiler, EagerCompiler)}


def make_compiler(name: str) -> PieceCompiler:
    if name not in COMPILERS:
        raise ConfigError(f"unknown graph compiler {name!r}: expected one of {', '.join(COMPILERS)}")
    return COMPILERS[name]()


def _graph_device(graph: GraphModule) -> torch.device:
    for node in graph.graph.nodes:
        value = node.meta.get("example_value") if node.op == "placeholder" else None
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def returns_tuple(graph: GraphModule) -> bool:
    output = next(n for n in reversed(graph.graph.nodes) if n.op == "output")
    return isinstance(output.args[0], (tuple, list))


def make_tuple_output(graph: GraphModule) -> bool:
    """Make `graph` return a sequence, what every compiler expects: a single output becomes a one-element tuple
    (in place). True when it already returned one (its callers get the sequence), False when its callers want
    element 0 of what the compiled code returns."""
    if returns_tuple(graph):
        return True
    output = next(n for n in reversed(graph.graph.nodes) if n.op == "output")
    output.args = ((output.args[0],),)
    graph.recompile()
    return False


class _new_generated_modules:
    """Collects the Python modules inductor generates (or reloads) inside the block."""

    def __enter__(self) -> list[Any]:
        # NOTE: inductor loads on first use (importing it takes ~1 s): an eager engine never pays for it.
        from torch._inductor.codecache import PyCodeCache

        self._code_cache = PyCodeCache
        self._start = len(PyCodeCache.modules)
        self.modules: list[Any] = []
        return self.modules

    def __exit__(self, *exc: object) -> None:
        self.modules.extend(self._code_cache.modules[self._start :])


def _source(modules: list[Any]) -> str | None:
    for module in reversed(modules):
        path = getattr(module, "__file__", None)
        if path and Path(path).is_file():
            return Path(path).read_text()
    return None
