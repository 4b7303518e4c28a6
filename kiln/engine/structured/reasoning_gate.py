"""`ReasoningGate`: where a reasoning model's answer starts, for its structured output's grammar (plain data, so the
server's parsers and flags read it without importing torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningGate:
    """Where a reasoning model's answer starts: the grammar holds the output only after the token ids `end` (the
    reasoning's closing tag). `inside`: the output starts inside the reasoning (the prompt opened it); else `start`
    (the opening tag, when it is one token) may open a reasoning as the output's first token."""

    end: tuple[int, ...]
    start: int | None = None
    inside: bool = False

    def __post_init__(self) -> None:
        if not self.end:
            raise ValueError("a reasoning gate needs the token ids of the reasoning's closing tag")
