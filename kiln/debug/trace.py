"""Trace mode: every piece launch logged (piece, mode, real and padded size, time) and replays checked.

`KILN_DEBUG=1`, or a recipe with `debug: {debug_mode: true}`, turns it on (the debug session applies it with
`GraphControls.set_trace_level`). The launch log and the replay check
live in `Piece` (kiln/compile/piece.py), the check itself in `Capture.check_bound_inputs`: a replay whose static
input buffers are not the ones the capture reads (a CUDA graph reads fixed addresses) fails loudly instead of
silently computing on stale data.
"""

from __future__ import annotations

from typing import Any

from kiln.env import read_env


def trace_level(recipe: Any = None) -> int:
    """KILN_DEBUG, raised to 1 when the recipe asks for debug mode."""
    level = read_env().debug
    if recipe is not None and getattr(recipe, "debug_mode", False):
        level = max(level, 1)
    return level
