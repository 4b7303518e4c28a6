"""`kiln compile --model M [--recipe R] --out DIR`: build graph mode once and write every artifact to DIR."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_compile_subcommand(sub: argparse._SubParsersAction) -> None:
    from kiln.cli import add_engine_args

    p = sub.add_parser(
        "compile",
        help="trace, split, compile and capture the model; write pieces, graph.dot, lint, profile, fusion report",
    )
    add_engine_args(p)
    p.add_argument("--out", required=True, help="directory for the artifacts (pieces/, graph.dot, lint.txt, ...)")
    p.set_defaults(func=cmd_compile)


def cmd_compile(args: argparse.Namespace) -> int:
    from kiln.cli import make_llm
    from kiln.compile.artifacts import write_trace_failure
    from kiln.compile.diagnose import GraphTraceError

    out = Path(args.out)
    full_graph = bool(args.full_graph)
    try:
        llm = make_llm(args, enable_piecewise_graph=not full_graph, full_graph=full_graph, dump_dir=str(out))
    except GraphTraceError as exc:
        write_trace_failure(exc, out)
        print(f"kiln: wrote the graph-break report to {out / 'lint.txt'}", file=sys.stderr)
        raise
    graph = llm.engine.runner.graph_runner
    assert graph is not None
    summary = {
        "out": str(out),
        "pieces": len(graph.pieces),
        "build_s": round(graph.build_seconds, 2),
        "counters": graph.counters.as_dict(),
        "files": sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()),
    }
    print(json.dumps(summary, indent=1))
    return 0
