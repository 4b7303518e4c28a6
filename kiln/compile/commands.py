"""`kiln compile`: build graph mode once through `build_engine` and write every artifact to --out."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kiln.compile.artifacts import write_trace_failure
from kiln.compile.diagnose import GraphTraceError
from kiln.compile.executor import GraphExecutor
from kiln.engine.args import EngineArgs
from kiln.engine.build import build_engine
from kiln.log import setup_logging


def cmd_compile(args: argparse.Namespace) -> int:
    setup_logging()
    out = Path(args.out)
    engine_args = EngineArgs.from_cli_args(args, enable_piecewise_graph=True, dump_dir=str(out))
    try:
        engine = build_engine(engine_args.create_engine_config())
    except GraphTraceError as exc:
        write_trace_failure(exc, out)
        print(f"kiln: wrote the graph-break report to {out / 'lint.txt'}", file=sys.stderr)
        raise
    graph = engine.executor
    assert isinstance(graph, GraphExecutor)
    summary = {
        "out": str(out),
        "pieces": len(graph.pieces),
        "build_s": round(graph.build_seconds, 2),
        "counters": graph.counters.as_dict(),
        "files": sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()),
    }
    print(json.dumps(summary, indent=1))
    return 0
