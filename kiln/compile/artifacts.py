"""Compile artifacts: what graph mode built, as files a person (or a test) can read.

DIR/pieces/piece_K.txt    FX IR of each piece, one node a line with its module path and source line
DIR/pieces/piece_K.generated.py   the compiler's generated code, when it has any
DIR/full_decode.txt (+ .generated.py, .nN.generated.py)   the same for the full decode graph, where the graph
                          mode has one: its IR, and its layer units' code for any num_tokens and per static size
DIR/graph.dot (+ .svg)    pieces coloured by mode, splitting ops between them, fusion groups outlined
DIR/lint.txt              nodes that become needless kernels, and graph breaks
DIR/kernel_profile.json   per piece: ops, generated kernels, static buffer bytes, latency per capture size; the
                          full decode graph's the same, per distinct layer unit (`full_decode_graph`, or null)
DIR/fusion.json           per recipe fusion group: realised (kiln.compile.fusion), or the op that broke it and why,
                          in the pieces (`groups`) and in the full decode graph (`full_decode_graph`, or null)
"""

from __future__ import annotations

import itertools
import json
import logging
import shutil
import subprocess
from pathlib import Path
from typing import Any, Protocol

import torch

from kiln.compile.counters import CompileCounters
from kiln.compile.decode_units import LayerUnits, unit_store_key
from kiln.compile.diagnose import GraphTraceError
from kiln.compile.full_graph import FullDecodeGraph
from kiln.compile.fusion import FusionReport, as_json, fusion_reports, piece_code
from kiln.compile.kernels import kernels_in
from kiln.compile.lint import lint_graph
from kiln.compile.piece import Piece
from kiln.compile.split import node_module_path, op_name
from kiln.config import GraphConfig
from kiln.graph_mode import GraphMode

logger = logging.getLogger("kiln")


class BuiltGraph(Protocol):
    """What the artifacts read of a built graph mode (kiln.executor.graph.GraphExecutor provides it)."""

    config: GraphConfig
    device: torch.device
    capture_sizes: list[int]
    compile_sizes: tuple[int, ...]
    mode: GraphMode
    counters: CompileCounters
    kernel_choices: dict[str, dict[str, object]]
    full: FullDecodeGraph | None

    @property
    def pieces(self) -> list[Piece]: ...

    @property
    def splitting_submods(self) -> list[str]: ...

    @property
    def compile_seconds(self) -> dict[str, float]: ...

    @property
    def cache_sources(self) -> dict[str, str]: ...


MODE_COLOURS = {"captured": "#b7e4c7", "compiled": "#ffe8a3", "eager": "#d9d9d9"}


def write_artifacts(runner: BuiltGraph, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    pieces_dir = out / "pieces"
    pieces_dir.mkdir(exist_ok=True)
    for piece in runner.pieces:
        (pieces_dir / f"piece_{piece.index}.txt").write_text(piece_ir(piece))
        if piece.compiled is not None and piece.compiled.source_code:
            (pieces_dir / f"piece_{piece.index}.generated.py").write_text(piece.compiled.source_code)
        for size, compiled in piece.static_compiled.items():
            if compiled.source_code:
                (pieces_dir / f"piece_{piece.index}.n{size}.generated.py").write_text(compiled.source_code)
    if runner.full is not None:
        write_full_decode(runner.full, out)
    groups, compiler = runner.config.fusion_groups, runner.config.compiler
    fusion = fusion_reports([piece_code(p) for p in runner.pieces], groups, compiler)
    full = fusion_reports(runner.full.checked_code(), groups, compiler) if runner.full is not None else None
    fusion_json = {"groups": as_json(fusion), "full_decode_graph": as_json(full) if full is not None else None}
    (out / "fusion.json").write_text(json.dumps(fusion_json, indent=1))
    (out / "kernel_profile.json").write_text(json.dumps(kernel_profile(runner), indent=1))
    (out / "lint.txt").write_text(lint_text(runner))
    dot = graph_dot(runner, fusion)
    (out / "graph.dot").write_text(dot)
    _render_svg(out / "graph.dot")
    logger.info("Wrote compile artifacts to %s", out)
    return out


def write_full_decode(full: FullDecodeGraph, out: Path) -> None:
    """The full decode graph's IR and generated code (its layer units', for any num_tokens and per static size)."""
    (out / "full_decode.txt").write_text(piece_ir(full.piece))
    for size, variant in full.variants.items():
        compiled = variant.piece.compiled
        if compiled is not None and compiled.source_code:
            name = "full_decode.generated.py" if size is None else f"full_decode.n{size}.generated.py"
            (out / name).write_text(compiled.source_code)


def write_trace_failure(error: GraphTraceError, out: Path) -> None:
    """The lint report of a forward that did not trace: its graph break, with module path and op."""
    out.mkdir(parents=True, exist_ok=True)
    lines = ["# kiln lint: the forward did not trace as one graph", "", "graph breaks: 1"]
    lines.append(f"  break in {error.module_path or '<top level>'} at op {error.op}")
    lines.append(f"    at {error.location}")
    lines.append(f"    reason: {error.reason}")
    (out / "lint.txt").write_text("\n".join(lines) + "\n")


def piece_ir(piece: Piece) -> str:
    lines = [
        f"# {piece.label}: {piece.describe()}",
        f"# mode: {piece.mode.value}   ops: {piece.num_ops}   structure: {piece.info.structure_key}",
        f"# modules: {', '.join(piece.info.module_paths)}",
    ]
    for node in piece.graph.graph.nodes:
        value = node.meta.get("example_value")
        shape = f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}" if hasattr(value, "shape") else ""
        if node.op == "placeholder":
            lines.append(f"input  %{node.name}: {shape}")
            continue
        if node.op == "output":
            lines.append(f"return {node.args[0]}")
            continue
        args = ", ".join([_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()])
        where = node_module_path(node) or "<top level>"
        lines.append(f"%{node.name} = {op_name(node.target)}({args}) -> {shape}    # {where} {_source_line(node)}")
    return "\n".join(lines) + "\n"


def kernel_profile(runner: BuiltGraph) -> dict[str, Any]:
    pieces = []
    for piece in runner.pieces:
        source = piece.compiled.source_code if piece.compiled is not None else None
        kernels = kernels_in(source) if source else []
        pieces.append(
            {
                "piece": piece.index,
                "modules": piece.describe(),
                "mode": piece.mode.value,
                "structure": piece.info.structure_key,
                "op_count": piece.num_ops,
                "kernel_count": len(kernels) if source else None,
                "generated_kernels": sum(not k.is_extern for k in kernels),
                "extern_kernels": sum(k.is_extern for k in kernels),
                "kernels": [k.name for k in kernels],
                "compile_s": round(runner.compile_seconds.get(piece.info.structure_key, 0.0), 4),
                "compiled_from": runner.cache_sources.get(piece.info.structure_key),
                "static_buffer_bytes": sum(c.static_bytes for c in piece.captures.values()),
                "latency_us": {str(n): round(c.latency_s * 1e6, 2) for n, c in sorted(piece.captures.items())},
                # captures of these sizes run code compiled for that static num_tokens
                "static_kernels": {
                    str(n): [k.name for k in kernels_in(c.source_code)] if c.source_code else None
                    for n, c in sorted(piece.static_compiled.items())
                },
            }
        )
    return {
        "compiler": runner.config.compiler,
        "device": str(runner.device),
        "capture_sizes": runner.capture_sizes,
        "compile_sizes": list(runner.compile_sizes),
        "kernel_choices": runner.kernel_choices,
        "graph_mode": runner.mode.value,
        "counters": runner.counters.as_dict(),
        "pieces": pieces,
        "full_decode_graph": full_decode_profile(runner, runner.full) if runner.full is not None else None,
    }


def full_decode_profile(runner: BuiltGraph, full: FullDecodeGraph) -> dict[str, Any]:
    """The full decode graph's ops, kernels per step and per distinct layer unit, captures and their latency."""
    piece, units = full.piece, full.variants[None].units
    captures = {key: c for p in full.pieces for key, c in p.captures.items()}
    return {
        "label": piece.label,
        "mode": piece.mode.value,
        "sizes": full.sizes,
        "static_sizes": sorted(n for n in full.variants if n is not None),
        "op_count": piece.num_ops,
        "layer_units": len(units.units) if units is not None else None,
        "kernel_count": sum(len(kernels_in(s)) for s in units.sources if s) if units is not None else None,
        "units": _unit_profiles(runner, units) if units is not None else [],
        "static_buffer_bytes": sum(c.static_bytes for c in captures.values()),
        # CUDA graphs per (num_tokens, table width in blocks); none on CPU, which calls the compiled graph
        "latency_us": {f"{n}x{w}": round(c.latency_s * 1e6, 2) for (n, w), c in sorted(captures.items())},
    }


def _unit_profiles(runner: BuiltGraph, units: LayerUnits) -> list[dict[str, Any]]:
    """One entry per distinct layer unit: which units share its code, and that code's kernels."""
    layers: dict[str, list[int]] = {}
    for i, key in enumerate(units.keys):
        layers.setdefault(key, []).append(i)
    out = []
    for key, indices in layers.items():
        source = units.sources[indices[0]]
        kernels = kernels_in(source) if source else []
        out.append(
            {
                "structure": key,
                "layer_units": indices,
                "kernel_count": len(kernels) if source else None,
                "generated_kernels": sum(not k.is_extern for k in kernels),
                "extern_kernels": sum(k.is_extern for k in kernels),
                "kernels": [k.name for k in kernels],
                "compile_s": round(runner.compile_seconds.get(unit_store_key(key), 0.0), 4),
                "compiled_from": runner.cache_sources.get(unit_store_key(key)),
            }
        )
    return out


def lint_text(runner: BuiltGraph) -> str:
    findings = [f for piece in runner.pieces for f in lint_graph(piece.index, piece.graph)]
    lines = [f"# kiln lint: {len(findings)} needless nodes in {len(runner.pieces)} pieces", ""]
    lines += [f.line() for f in findings]
    lines += ["", "graph breaks: 0 (the forward traced as one graph)"]
    return "\n".join(lines) + "\n"


def graph_dot(runner: BuiltGraph, fusion: list[FusionReport]) -> str:
    lines = ["digraph kiln {", "  rankdir=TB;", '  node [shape=box, style="filled", fontname="monospace"];']
    fused = {(r.piece, r.scope): r for r in fusion if r.piece is not None}
    order: list[str] = []
    splits = iter(runner.splitting_submods)
    for piece in runner.pieces:
        colour = MODE_COLOURS[piece.mode.value]
        lines.append(f"  subgraph cluster_piece_{piece.index} {{")
        lines.append(f'    label="piece {piece.index} ({piece.mode.value})"; style=filled; fillcolor="{colour}";')
        open_group: FusionReport | None = None
        for j, path in enumerate(piece.info.module_paths):
            name = f"p{piece.index}_{j}"
            report = next(
                (r for (idx, scope), r in fused.items() if idx == piece.index and path.startswith(scope)), None
            )
            if report is not open_group and open_group is not None:
                lines.append("    }")
            if report is not None and report is not open_group:
                status = "applied" if report.realised else "not applied"
                lines.append(f"    subgraph cluster_fusion_{piece.index}_{j} {{")
                lines.append(f'      label="{report.name}: {status}"; style=dashed; color=blue;')
            open_group = report
            lines.append(f'    {name} [label="{path}", fillcolor=white];')
            order.append(name)
        if open_group is not None:
            lines.append("    }")
        lines.append("  }")
        split = next(splits, None)
        if split is not None:
            sname = f"split_{split}"
            lines.append(
                f'  {sname} [label="{", ".join(runner.config.splitting_ops)}", shape=ellipse, fillcolor=white];'
            )
            order.append(sname)
    lines += [f"  {a} -> {b};" for a, b in itertools.pairwise(order)]
    lines.append("}")
    return "\n".join(lines) + "\n"


def _render_svg(dot_path: Path) -> None:
    dot = shutil.which("dot")
    if dot is None:
        return
    result = subprocess.run(
        [dot, "-Tsvg", str(dot_path), "-o", str(dot_path.with_suffix(".svg"))], capture_output=True, text=True
    )
    if result.returncode != 0:
        logger.warning("dot could not render %s: %s", dot_path, result.stderr.strip())


def _arg(a: object) -> str:
    return f"%{a.name}" if hasattr(a, "name") and hasattr(a, "op") else repr(a)


def _source_line(node: Any) -> str:
    trace = node.meta.get("stack_trace") or ""
    frames = [line.strip() for line in trace.splitlines() if line.strip().startswith("File ")]
    if not frames:
        return ""
    parts = frames[-1].split('"')
    line = frames[-1].split("line ")[-1].split(",")[0] if "line " in frames[-1] else "?"
    return f"({Path(parts[1]).name}:{line})" if len(parts) > 1 else ""
