"""Run-time dispatch: per step, replay the captures of the batch's padded size or run the pieces dynamically.

`pad_to(n)` is the smallest captured size >= n (n itself above the largest). A step at a captured size copies
its inputs into that size's static buffers and runs the split graph, whose pieces replay; in full-graph mode only
decode-only batches replay (attention lives inside the graph). Any other step runs the dynamic compiled code.
"""

from __future__ import annotations

import bisect

import torch

from kiln.compile.build import PiecewiseGraph
from kiln.executor.counters import CompileCounters
from kiln.model.forward_context import AttentionMetadata


class Dispatcher:
    def __init__(
        self,
        graph: PiecewiseGraph,
        static_inputs: dict[int, tuple[torch.Tensor, torch.Tensor]],
        counters: CompileCounters,
    ) -> None:
        self.graph = graph
        self.static_inputs = static_inputs  # owned by the Capturer, filled as sizes are captured
        self.counters = counters

    def pad_to(self, num_tokens: int) -> int:
        sizes = sorted(self.static_inputs)
        i = bisect.bisect_left(sizes, num_tokens)
        return sizes[i] if i < len(sizes) else num_tokens

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = input_ids.shape[0]
        self.counters.padding_tokens += n - meta.num_actual_tokens
        static = self.static_inputs.get(n)
        if static is not None and (not self.graph.is_full_graph or meta.num_decodes == meta.num_seqs):
            self.counters.replays += 1
            ids, pos = static
            ids.copy_(input_ids)
            pos.copy_(positions)
            return self.graph.run(ids, pos)
        self.counters.dynamic_fallbacks += 1
        return self.graph.run_dynamic(input_ids, positions)
