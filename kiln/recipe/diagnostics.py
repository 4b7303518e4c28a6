"""Compiler-style diagnostics: `FILE:LINE:COL: severity: message`, the source line, and a caret under the problem."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from kiln.errors import KilnError

Severity = Literal["error", "warning", "info"]


@dataclass(frozen=True)
class Diagnostic:
    """One finding about a recipe. `line` and `col` are 1-based; 0 means "the whole file"."""

    file: str
    line: int
    col: int
    severity: Severity
    message: str
    source_line: str | None = None
    # NOTE: how many characters the caret underlines (`^~~~`), so an unknown name is marked whole.
    length: int = 1

    def format(self) -> str:
        where = f"{self.file}:{self.line}:{self.col}" if self.line > 0 else self.file
        text = f"{where}: {self.severity}: {self.message}"
        if self.source_line is None or self.line <= 0:
            return text
        caret = " " * max(self.col - 1, 0) + "^" + "~" * max(self.length - 1, 0)
        return f"{text}\n{self.source_line}\n{caret}"

    def to_json(self) -> dict:
        return asdict(self)


class RecipeError(KilnError):
    """A recipe that kiln refuses to compile; `.diagnostics` holds every error (and warning) found."""

    def __init__(self, diagnostics: list[Diagnostic]) -> None:
        self.diagnostics = list(diagnostics)
        super().__init__("\n".join(d.format() for d in self.diagnostics))


def has_errors(diagnostics: list[Diagnostic]) -> bool:
    return any(d.severity == "error" for d in diagnostics)


def sort_diagnostics(diagnostics: list[Diagnostic]) -> list[Diagnostic]:
    """File order, errors before warnings on the same line; duplicates (same place and text) dropped."""
    order = {"error": 0, "warning": 1, "info": 2}
    unique = list(dict.fromkeys(diagnostics))
    return sorted(unique, key=lambda d: (d.line, d.col, order[d.severity]))
