"""Graph build: trace the forward once (num_tokens symbolic), split it at the splitting ops into pieces.

`PiecewiseForward` is the result: the pieces, the outer graph that calls them in order with the splitting ops
between, and the binding of a step's `input_ids`/`positions`/`num_tokens` to the traced placeholders. In full-graph
mode there is one piece, the whole forward. The piece count comes from the split, never from the layer count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kiln.compile.backend import INPUT_IDS, NUM_TOKENS, POSITIONS, TracedForward
from kiln.compile.counters import CompileCounters
from kiln.compile.piece import Piece
from kiln.compile.split import SplitPiece, module_paths, split_graph, structure_key
from kiln.compile.stamp import trace_model
from kiln.errors import ConfigError


@dataclass
class PiecewiseForward:
    traced: TracedForward
    pieces: list[Piece]
    outer: nn.Module  # the split graph (or, unsplit, the single piece)
    splitting_submods: list[str]
    is_split: bool  # False: the whole forward is one piece, attention inside (graph mode full)

    def __post_init__(self) -> None:
        self._args = list(self.traced.bound)
        slots = self.traced.slots
        self._slot_index = {slot: [i for i, s in enumerate(slots) if s == slot] for slot in set(slots) if slot}

    def bind(self, input_ids: torch.Tensor, positions: torch.Tensor) -> list[Any]:
        """The traced placeholders' values for one step (parameters stay bound)."""
        args = self._args
        for i in self._slot_index.get(INPUT_IDS, ()):
            args[i] = input_ids
        for i in self._slot_index.get(POSITIONS, ()):
            args[i] = positions
        n = input_ids.shape[0]
        for i in self._slot_index.get(NUM_TOKENS, ()):
            args[i] = n
        return args

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The forward through every piece in its current mode: hidden states [num_tokens, hidden]."""
        return self.outer(*self.bind(input_ids, positions))[0]

    def run_dynamic(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The forward ignoring captures (a size without one); unsplit, the compiled whole graph."""
        args = self.bind(input_ids, positions)
        out = self.outer(*args) if self.is_split else self.pieces[0].run_dynamic(*args)
        return out[0]


def build_graph(
    model: nn.Module,
    kv_caches: list[torch.Tensor],
    device: torch.device,
    splitting_ops: Sequence[str],
    split: bool,
    counters: CompileCounters,
    sample_size: int = 8,
) -> PiecewiseForward:
    """Trace `model`'s forward and split it at `splitting_ops` (or keep it whole when not `split`)."""
    traced = trace_model(model, kv_caches, device, sample_size)
    counters.graphs_traced += 1
    if not split:
        gm = traced.gm
        pieces = [
            Piece(
                SplitPiece(
                    index=0, submod_name="", graph=gm, structure_key=structure_key(gm), module_paths=module_paths(gm)
                ),
                counters,
            )
        ]
        graph = PiecewiseForward(traced=traced, pieces=pieces, outer=pieces[0], splitting_submods=[], is_split=False)
    else:
        try:
            cut = split_graph(traced.gm, tuple(splitting_ops))
        except ValueError as exc:
            raise ConfigError(f"cannot split the forward for piecewise graph mode: {exc}") from None
        pieces = [Piece(info, counters) for info in cut.pieces]
        for piece in pieces:
            # NOTE: the split graph calls its submodules by attribute: the Piece (not the bare FX graph) runs there.
            setattr(cut.split_gm, piece.info.submod_name, piece)
        graph = PiecewiseForward(
            traced=traced, pieces=pieces, outer=cut.split_gm, splitting_submods=cut.splitting_submods, is_split=True
        )
    counters.pieces_seen = len(graph.pieces)
    counters.splitting_ops_seen = len(graph.splitting_submods)
    return graph
