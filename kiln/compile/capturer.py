"""Capture: record pieces at every capture size, largest first, by running the forward once per size on padding.

While a size is being captured each target piece gets a capture hook: the piece's compiled code for that size
(its static compile if it has one) is wrapped in a `Capture` over the real arguments of that forward. Outputs of
one capture are adopted as the next piece's static inputs (no copy between captured pieces). `capture` returns
the static `input_ids`/`positions` buffers of each size it captured (the same buffers every time a size is captured
again, since the first piece's captures read them); the executor hands them to the dispatcher, which copies a
step's inputs into them.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch
from tqdm import tqdm

from kiln.compile.backend import padding_context
from kiln.compile.build import PiecewiseForward
from kiln.compile.capture import make_capture
from kiln.compile.counters import CompileCounters
from kiln.compile.piece import Piece
from kiln.model.forward_context import set_forward_context
from kiln.platforms import platform_of

logger = logging.getLogger("kiln")


class StaticInputs(NamedTuple):
    """The buffers a size's captures read a step's inputs from."""

    input_ids: torch.Tensor
    positions: torch.Tensor


class Capturer:
    def __init__(
        self, graph: PiecewiseForward, kv_caches: list[torch.Tensor], device: torch.device, counters: CompileCounters
    ) -> None:
        self.graph = graph
        self.kv_caches = kv_caches
        self.device = device
        self.counters = counters
        self.platform = platform_of(device)
        self.pool = self.platform.new_graph_pool()  # one memory pool shared by every recorded graph
        self._inputs: dict[int, StaticInputs] = {}  # size -> its buffers, made at the size's first capture

    def capture(self, pieces: list[Piece], sizes: list[int]) -> dict[int, StaticInputs]:
        """Capture `pieces` at every size in `sizes`, largest first; each size's static input buffers."""
        targets = set(map(id, pieces))
        for n in sorted(sizes, reverse=True):
            ids, pos = self._inputs.setdefault(n, StaticInputs(self._zeros(n), self._zeros(n)))
            adopt = {id(ids), id(pos)}
            free_gb = self.platform.available_memory_gb(self.device)
            desc = f"Capturing num tokens (num_tokens={n} avail_mem={free_gb:.2f} GB)"
            bar = tqdm(total=len(pieces), desc=desc, leave=False, delay=1.0)

            def hook(piece: Piece, args: tuple[Any, ...], n: int = n, adopt: set[int] = adopt, bar: tqdm = bar) -> Any:
                compiled = piece.static_compiled.get(n, piece.compiled)
                assert compiled is not None, f"piece {piece.index} is captured before it was compiled"
                capture = make_capture(
                    self.device, compiled.fn, args, dynamic_args=piece.dynamic_args, adopt=adopt, pool=self.pool
                )
                piece.add_capture(n, capture)
                adopt.update(id(o) for o in capture.outputs)
                self.counters.pieces_captured += 1
                bar.update(1)
                return capture.outputs

            for piece in self.graph.pieces:
                piece.set_capture_hook(hook if id(piece) in targets else None)
            try:
                with torch.inference_mode(), set_forward_context(padding_context(n, self.kv_caches, self.device)):
                    self.graph.outer(*self.graph.bind(ids, pos))
            finally:
                for piece in self.graph.pieces:
                    piece.set_capture_hook(None)
                bar.close()
            logger.info("%s: 100%%", desc)
        return {n: self._inputs[n] for n in sizes}

    def _zeros(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.long, device=self.device)
