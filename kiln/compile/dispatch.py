"""Run-time dispatch: per step, the full decode graph, the pieces' captures, or the pieces run dynamically.

The dispatcher reads only the graph mode (kiln.graph_mode.GraphMode), the static inputs of the sizes captured so
far (`add_static_inputs`, from what the capturer returns) and one explicit override, the debugger's
`use_full_decode_graph(False)`. `pad_to(n)` is the smallest capture size >= n (n itself above the largest). Then,
in order:
- a decode-only step at a size the full decode graph has (and a block table it can take) replays it (`full`);
- a step at a size the pieces captured runs the split graph, whose pieces replay (`piecewise`);
- any other step runs the dynamic compiled code (`dynamic`); in mode full, the whole forward compiled.
Each step's choice and, when the full decode graph was passed over, the reason, are counted and logged (debug).
"""

from __future__ import annotations

import bisect
import logging

import torch

from kiln.compile.build import PiecewiseForward
from kiln.compile.capturer import StaticInputs
from kiln.compile.counters import CompileCounters
from kiln.compile.full_graph import FullDecodeGraph
from kiln.graph_mode import GraphMode
from kiln.model.forward_context import ModelInputs

logger = logging.getLogger("kiln")

FULL, PIECEWISE, DYNAMIC = "full", "piecewise", "dynamic"


class Dispatcher:
    def __init__(
        self,
        mode: GraphMode,
        graph: PiecewiseForward,
        counters: CompileCounters,
        full: FullDecodeGraph | None = None,
    ) -> None:
        self.mode = mode
        self.graph = graph
        self.static_inputs: dict[int, StaticInputs] = {}  # the sizes whose pieces replay captures
        self.counters = counters
        self.full = full if mode.has_full_decode_graph else None
        self.full_enabled = self.full is not None
        self.last: tuple[str, str] = ("", "")  # (graph that ran the last step, why the full graph did not)

    def pad_to(self, num_tokens: int) -> int:
        sizes = sorted(set(self.static_inputs) | set(self.full.sizes if self.full is not None else ()))
        i = bisect.bisect_left(sizes, num_tokens)
        return sizes[i] if i < len(sizes) else num_tokens

    def add_static_inputs(self, inputs: dict[int, StaticInputs]) -> None:
        """Sizes just captured (kiln.compile.capturer): their steps copy into these buffers and replay the pieces."""
        self.static_inputs.update(inputs)

    def use_full_decode_graph(self, enabled: bool) -> None:
        """False: decode-only steps run the pieces too (the debugger's per-piece bisection localizes there)."""
        self.full_enabled = enabled and self.full is not None

    def run(self, batch: ModelInputs) -> torch.Tensor:
        input_ids, meta = batch.input_ids, batch.metadata
        n = input_ids.shape[0]
        self.counters.padding_tokens += n - meta.num_actual_tokens
        reason = ""
        self.counters.verify_steps += bool(batch.num_draft_tokens)
        if self.full is not None and self.full_enabled:
            if meta.num_decodes != meta.num_seqs:
                reason = f"mixed batch: {meta.num_seqs - meta.num_decodes} prefill"
                self.counters.full_fallbacks_mixed += 1
            elif not self.full.fits(batch, n):
                reason = f"{n} tokens or {meta.block_tables.shape[1]} blocks per sequence are not captured"
                self.counters.full_fallbacks_size += 1
            else:
                self.counters.full_replays += 1
                self.counters.full_verify_replays += bool(batch.num_draft_tokens)
                self._log(FULL, n, meta.num_actual_tokens, reason=reason, num_drafts=batch.num_draft_tokens)
                return self.full.run(batch, n)
        static = self.static_inputs.get(n)
        if static is not None and self.mode.splits_forward:
            self.counters.replays += 1
            self._log(PIECEWISE, n, meta.num_actual_tokens, reason=reason, num_drafts=batch.num_draft_tokens)
            ids, pos = static
            ids.copy_(input_ids)
            pos.copy_(batch.positions)
            return self.graph.run(ids, pos)
        self.counters.dynamic_fallbacks += 1
        self._log(DYNAMIC, n, meta.num_actual_tokens, reason=reason, num_drafts=batch.num_draft_tokens)
        return self.graph.run_dynamic(input_ids, batch.positions)

    def _log(self, kind: str, padded: int, real: int, reason: str, num_drafts: int = 0) -> None:
        self.last = (kind, reason)
        if logger.isEnabledFor(logging.DEBUG):
            why = f" (not the full graph: {reason})" if reason else ""
            drafts = f", verifying {num_drafts} draft tokens" if num_drafts else ""
            logger.debug("step: %s graph, num_tokens=%d padded=%d%s%s", kind, real, padded, drafts, why)
