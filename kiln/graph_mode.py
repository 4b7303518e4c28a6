"""The one graph-mode value (vLLM's cudagraph modes, plus eager) and what each mode runs: the bottom of the config
layer (kiln.config builds on it), importing nothing of kiln."""

from __future__ import annotations

from enum import StrEnum


class GraphMode(StrEnum):
    """What each kind of step runs: the one graph-mode value (vLLM's cudagraph modes, plus eager), parsed once from
    `--graph-mode` or the recipe's `graph.mode` (kiln.compile.settings). The executor builds what it asks for and
    the dispatcher (kiln.compile.dispatch) reads only it.

    | mode               | decode-only steps             | steps with a prefill                |
    |--------------------|-------------------------------|-------------------------------------|
    | full_and_piecewise | the full decode graph         | the pieces, captured per size       |
    | piecewise          | the pieces, captured per size | the pieces, captured per size       |
    | full_decode_only   | the full decode graph         | the pieces, compiled, not captured  |
    | full               | the full decode graph         | the whole forward compiled (no split) |
    | eager              | the model's forward, op by op | the model's forward, op by op       |
    """

    FULL_AND_PIECEWISE = "full_and_piecewise"
    PIECEWISE = "piecewise"
    FULL_DECODE_ONLY = "full_decode_only"
    FULL = "full"
    EAGER = "eager"

    @property
    def is_graph(self) -> bool:
        """Any graph at all (the graph executor); False: the eager executor."""
        return self is not GraphMode.EAGER

    @property
    def has_full_decode_graph(self) -> bool:
        """Decode-only steps replay the full decode graph (attention inside)."""
        return self in (GraphMode.FULL_AND_PIECEWISE, GraphMode.FULL_DECODE_ONLY, GraphMode.FULL)

    @property
    def splits_forward(self) -> bool:
        """Steps with a prefill run the forward split at attention (False: as one graph, attention inside)."""
        return self is not GraphMode.FULL

    @property
    def captures_pieces(self) -> bool:
        """The pieces are captured per size (else, in a graph mode, they run compiled for the dynamic shape)."""
        return self in (GraphMode.FULL_AND_PIECEWISE, GraphMode.PIECEWISE)


GRAPH_MODES = tuple(m.value for m in GraphMode)
DEFAULT_GRAPH_MODE = GraphMode.FULL_AND_PIECEWISE
