"""How often the packed kernel table's choices differ between timings on this machine: the default model's table is
timed from scratch several times in one process (each into a fresh cache, the process's memo forgotten between),
and every (layout, row class) whose winner differs between the timings is listed with the times each saw.

Usage: .venv/bin/python scripts/table_flips.py [--runs 2] [--threads 2] [--activations int8x2]
Prints each timing's seconds, then the choices that flipped (of all the table makes) and their times.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from kiln.compile.compiler import make_compiler
from kiln.kernels.choices import KernelChoiceCache, forget_process_choices
from kiln.kernels.packed import PackedKernelTable
from kiln.model.build import build_model
from kiln.model.loader import open_checkpoint


def time_table(model: torch.nn.Module, activations: str) -> tuple[float, dict[str, dict]]:
    forget_process_choices()
    with tempfile.TemporaryDirectory() as cache_dir:
        start = time.perf_counter()
        table = PackedKernelTable(model, make_compiler("inductor"), KernelChoiceCache(cache_dir), activations)
        return time.perf_counter() - start, table.records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--activations", default="int8x2")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    checkpoint = open_checkpoint("default")
    model = build_model(checkpoint, torch.float32, max_positions=2048, quantization="packed")
    timings = [time_table(model, args.activations) for _ in range(args.runs)]
    for i, (seconds, _) in enumerate(timings):
        print(f"timing {i + 1}: {seconds:.1f} s")
    first = timings[0][1]
    flips, total = [], 0
    for layout, record in first.items():
        for rows in record["winners"]:
            total += 1
            seen = [records[layout]["winners"].get(rows) for _, records in timings]
            if len(set(seen)) > 1:
                flips.append((layout, rows, seen, [records[layout]["times_us"].get(rows) for _, records in timings]))
    print(f"{len(flips)} of {total} choices differ between the {args.runs} timings")
    for layout, rows, seen, times in flips:
        print(f"  {layout} at {rows} rows: {' / '.join(seen)}")
        for run_times in times:
            best = sorted(run_times.items(), key=lambda item: item[1])[:3]
            print("    " + ", ".join(f"{name} {us:.0f} us" for name, us in best))


if __name__ == "__main__":
    main()
