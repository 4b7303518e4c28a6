"""`GraphControls`: the debugger's controls over a built graph executor (kiln.executor.graph.GraphExecutor).

The engine never calls these; kiln.debug does (the session's taps and path modes, fault injection, bisection):
- `set_piece_modes` / `set_full_mode`: force pieces (or the full decode graph) eager, compiled or captured; the
  executor compiles and captures what a mode needs;
- `use_full_decode_graph(False)`: decode-only steps run the pieces too, so per-piece modes localize a problem there
  (the dispatcher's one override, kiln.compile.dispatch);
- `rebuild` / `rebuild_full`: rewrite piece graphs (taps, faults), compiled again outside the on-disk cache;
- `set_piece_hooks`: hooks around a piece's launches (kiln.compile.piece: taps, stale-input faults);
- `set_trace_level`: trace mode on every piece and the full decode graph (kiln.debug.trace).
Every change goes through the executor's mode switches and the pieces' own methods.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.fx import GraphModule

from kiln.compile.modes import PieceMode
from kiln.compile.piece import AfterHook, BeforeHook, Piece
from kiln.executor.graph import GraphExecutor

PieceTransform = Callable[[Piece], GraphModule | None]


class GraphControls:
    def __init__(self, executor: GraphExecutor) -> None:
        self.executor = executor

    def set_piece_modes(self, modes: dict[int, PieceMode | str]) -> None:
        """Pieces to eager, compiled or captured (GraphExecutor.set_piece_modes)."""
        self.executor.set_piece_modes(modes)

    def set_full_mode(self, mode: PieceMode | str) -> None:
        """The full decode graph's mode (eager: its traced graph op by op); no-op without one."""
        self.executor.set_full_mode(mode)

    def use_full_decode_graph(self, enabled: bool) -> None:
        """False runs decode-only steps through the pieces too (so per-piece modes localize a problem there); True
        restores what the graph mode asks for."""
        self.executor.dispatcher.use_full_decode_graph(enabled)

    def rebuild(self, transform: PieceTransform, compiled_only: bool = False) -> list[int]:
        """Rewrite piece graphs: `transform(piece)` returns a new graph (same inputs, the piece's outputs first,
        extra outputs allowed) or None to keep it. With `compiled_only`, eager mode keeps the traced graph and
        only compiled code comes from the new one (a miscompile). Rewritten pieces are compiled again outside
        the on-disk cache and captured again in their current modes; returns their indices."""
        changed = []
        for piece in self.executor.pieces:
            new = transform(piece)
            if new is not None:
                piece.rewrite(new, compiled_only)
                changed.append(piece.index)
        self.executor.set_piece_modes({i: self.executor.pieces[i].mode for i in changed})
        return changed

    def rebuild_full(self, transform: Callable[[Piece], GraphModule]) -> None:
        """Rewrite every full decode graph (the one for any size and the static-size ones) with `transform`, as
        `rebuild` does pieces: compiled again outside the on-disk cache, captured again in its current mode."""
        full = self.executor.full
        assert full is not None, "rebuild_full needs a graph mode with a full decode graph"
        for piece in full.pieces:
            piece.rewrite(transform(piece))
        self.executor.set_full_mode(full.mode)

    def set_piece_hooks(self, index: int, before: BeforeHook | None = None, after: AfterHook | None = None) -> None:
        """Hooks around piece `index`'s launches (see kiln.compile.piece); None removes one."""
        self.executor.pieces[index].set_hooks(before, after)

    def set_trace_level(self, level: int) -> None:
        """Trace mode (kiln.debug.trace): log every launch and check replay inputs when level >= 1."""
        for piece in self.executor.all_pieces:
            piece.set_trace_level(level)
