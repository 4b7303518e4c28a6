"""The side-by-side tables printed by `kiln bench`."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from kiln.bench.metrics import RATIO_METRICS, RunResult
from kiln.bench.roofline import Roofline


def print_report(
    results: list[RunResult],
    ratios: dict[str, dict[str, Any]],
    console: Console | None = None,
    *,
    roofline: Roofline | None = None,
) -> None:
    # NOTE: a piped or logged report keeps its width instead of wrapping at 80 columns.
    console = console or Console(width=None if Console().is_terminal else 160)
    table = Table(title="kiln bench (TTFT / TPOT in ms: mean/p50/p90)")
    for name in ("system", "bs", "reqs", "out tok/s", "prefill tok/s", "decode tok/s/seq", "TTFT", "TPOT", "wall s"):
        table.add_column(name, justify="left" if name == "system" else "right")
    # columns shown when some run has the value: (heading, the cell of a run, None when it has none)
    optional = [
        ("=HF", lambda r: None if r.hf_match is None else f"{r.hf_match}/{r.num_requests}"),
        ("roofline", lambda r: None if r.roofline_efficiency is None else f"{r.roofline_efficiency:.0%}"),
        ("prefix hits", lambda r: None if r.prefix_hit_rate is None else f"{r.prefix_hit_rate:.0%}"),
        ("accept len", lambda r: None if r.acceptance_length is None else f"{r.acceptance_length:.2f}"),
    ]
    values = {id(r): [cell(r) for _, cell in optional] for r in results}  # each cell evaluated once
    shown = [i for i in range(len(optional)) if any(v[i] is not None for v in values.values())]
    for i in shown:
        table.add_column(optional[i][0], justify="right")
    for r in sorted(results, key=lambda r: (r.batch_size, r.system != "kiln", r.system, r.mode)):
        row = r.to_row()
        cells = [
            f"{r.system} {r.mode}",
            str(r.batch_size),
            str(r.num_requests),
            f"{r.output_tok_s:.1f}",
            f"{r.prefill_tok_s:.1f}",
            f"{r.decode_tok_s_per_seq:.1f}",
            _triple(row["ttft_ms"]),
            _triple(row["tpot_ms"]),
            f"{r.wall_s:.2f}",
        ]
        cells += [values[id(r)][i] or "" for i in shown]
        table.add_row(*cells)
    console.print(table)
    if roofline is not None:
        console.print(_roofline_summary(roofline))
    if ratios:
        console.print(_ratio_table(ratios))


def _roofline_summary(roofline: Roofline) -> str:
    """One line: kiln's weight bytes (resident, per decode token, the GGUF file's) and the batch-1 roofline."""
    file = ""
    if roofline.gguf_file_bytes is not None:
        file = f" ({roofline.resident_over_file:.2f}x the {roofline.gguf_file_bytes / 1e6:.1f} MB GGUF file)"
    tpot_ms = roofline.roofline_tpot_s * 1000.0
    return (
        f"kiln weights: {roofline.resident_weight_bytes / 1e6:.1f} MB resident{file}, second forms "
        f"{roofline.second_form_bytes / 1e6:.1f} MB, process RSS {roofline.process_rss_bytes / 1e6:.0f} MB, "
        f"{roofline.streamed_bytes_per_token / 1e6:.1f} MB read per decode token; read bandwidth "
        f"{roofline.read_bandwidth_gbs:.1f} GB/s -> batch-1 roofline {tpot_ms:.2f} ms/token "
        f"({1000.0 / tpot_ms:.1f} tok/s); roofline column = roofline ms/token over mean TPOT"
    )


def _triple(summary: dict[str, float]) -> str:
    return "/".join(f"{summary[k]:.1f}" if summary[k] < 100 else f"{summary[k]:.0f}" for k in ("mean", "p50", "p90"))


def _ratio_table(ratios: dict[str, dict[str, Any]]) -> Table:
    table = Table(title="ratios (best = best batched output tok/s of each)")
    table.add_column("ratio")
    table.add_column("bs", justify="right")
    for metric in RATIO_METRICS:
        table.add_column(metric, justify="right")
    for name, entry in ratios.items():
        for bs, value in entry.items():
            if bs == "best":
                table.add_row(name, "best", f"{value:.2f}x", "", "")
            else:
                table.add_row(name, bs, *(f"{value[m]:.2f}x" for m in RATIO_METRICS))
    return table
