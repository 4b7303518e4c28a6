"""Piece modes (`eager | compiled | captured`) and the `--piece-modes 0-3:captured,4:eager` syntax."""

from __future__ import annotations

from enum import StrEnum

from kiln.errors import ConfigError


class PieceMode(StrEnum):
    EAGER = "eager"  # the traced FX graph, run op by op
    COMPILED = "compiled"  # the compiler's output for the dynamic num_tokens
    CAPTURED = "captured"  # per capture size: a CUDA graph, or on CPU a static-buffer call


def parse_piece_modes(
    spec: str | dict[int, str] | tuple[tuple[int, str], ...] | None,
) -> dict[int, PieceMode]:
    """`"0-3:captured,4:eager"` (or `{4: "eager"}`, or GraphConfig's `((4, "eager"),)`) -> {piece index: mode};
    unlisted pieces stay captured."""
    if spec is None or spec == "":
        return {}
    if isinstance(spec, tuple):  # already parsed once (a recipe re-applies the flags' GraphConfig)
        spec = dict(spec)
    if isinstance(spec, dict):
        return {int(k): _mode(str(v), f"piece {k}") for k, v in spec.items()}
    modes: dict[int, PieceMode] = {}
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        span, sep, name = item.partition(":")
        if not sep:
            raise ConfigError(f"--piece-modes item {item!r}: expected INDEX:MODE or FIRST-LAST:MODE, e.g. 0-3:captured")
        mode = _mode(name.strip(), item)
        first, dash, last = span.strip().partition("-")
        try:
            lo = int(first)
            hi = int(last) if dash else lo
        except ValueError:
            raise ConfigError(f"--piece-modes item {item!r}: piece indices must be integers") from None
        if lo < 0 or hi < lo:
            raise ConfigError(f"--piece-modes item {item!r}: expected 0 <= FIRST <= LAST")
        for idx in range(lo, hi + 1):
            modes[idx] = mode
    return modes


def format_piece_modes(modes: dict[int, PieceMode]) -> str:
    """Inverse of `parse_piece_modes`, with runs of equal modes collapsed (`0-3:captured,4:eager`)."""
    items: list[str] = []
    indices = sorted(modes)
    i = 0
    while i < len(indices):
        j = i
        while j + 1 < len(indices) and indices[j + 1] == indices[j] + 1 and modes[indices[j + 1]] == modes[indices[i]]:
            j += 1
        span = str(indices[i]) if i == j else f"{indices[i]}-{indices[j]}"
        items.append(f"{span}:{modes[indices[i]].value}")
        i = j + 1
    return ",".join(items)


def _mode(name: str, where: str) -> PieceMode:
    try:
        return PieceMode(name)
    except ValueError:
        choices = ", ".join(m.value for m in PieceMode)
        raise ConfigError(f"piece mode {name!r} in {where!r}: expected one of {choices}") from None
