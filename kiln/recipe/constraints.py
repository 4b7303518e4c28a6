"""The recipe's constraints, parsed and placed: each knows the file line and column where its text starts."""

from __future__ import annotations

import ast
from dataclasses import dataclass

from kiln.recipe.diagnostics import Diagnostic
from kiln.recipe.expr import MODEL_SYMBOLS, RUNTIME_SYMBOLS, Expr, ExprError, parse_constraint
from kiln.recipe.source import SourceDoc

CONSTRAINTS_PATH = ("input_constraints", "constraints")


@dataclass(frozen=True)
class Constraint:
    """One constraint of the recipe; `line`/`col` (1-based) is where its first character sits in the file."""

    index: int
    expr: Expr
    line: int
    col: int

    @property
    def text(self) -> str:
        return self.expr.text.strip()

    @property
    def label(self) -> str:
        """`seq_len <= 2048 (line 9)`: how diagnostics refer to a constraint."""
        return f"{self.text} (line {self.line})"

    @property
    def runtime_symbols(self) -> frozenset[str]:
        return self.expr.symbols & frozenset(RUNTIME_SYMBOLS)

    @property
    def is_model_only(self) -> bool:
        """Mentions model symbols only: decided by the checkpoint alone, not by the solver."""
        return bool(self.expr.symbols) and self.expr.symbols <= frozenset(MODEL_SYMBOLS)

    def column(self, offset: int) -> int:
        """File column of a 0-based offset into the constraint text."""
        return self.col + offset - _lead(self.expr.text)

    def position_of(self, node: ast.AST) -> tuple[int, int]:
        return self.line, self.column(self.expr.offset_of(node))


def parse_constraints(doc: SourceDoc, texts: list[str]) -> tuple[list[Constraint], list[Diagnostic]]:
    """Parse every constraint; a bad one becomes a diagnostic with a caret under the problem."""
    constraints: list[Constraint] = []
    diagnostics: list[Diagnostic] = []
    for i, text in enumerate(texts):
        line, col = _text_start(doc, i, text)
        try:
            constraints.append(Constraint(i, parse_constraint(text), line, col))
        except ExprError as exc:
            at = col + exc.offset - _lead(text) if "\n" not in text else col
            diagnostics.append(doc.at("error", exc.message, line=line, col=at, length=exc.length))
    return constraints, diagnostics


def _text_start(doc: SourceDoc, index: int, text: str) -> tuple[int, int]:
    """Where the constraint's first non-blank character is: past an opening quote, on the line it starts."""
    line, col = doc.position((*CONSTRAINTS_PATH, index))
    source = doc.source_line(line) or ""
    rest = source[col - 1 :]
    if rest[:1] in ("'", '"'):
        return line, col + 1 + _lead(text)
    if rest[:1] in ("|", ">"):  # block scalar: the text starts on the next line
        following = doc.source_line(line + 1) or ""
        return line + 1, len(following) - len(following.lstrip()) + 1
    return line, col


def _lead(text: str) -> int:
    return len(text) - len(text.lstrip())
