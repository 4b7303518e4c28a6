"""The constraint language: Python syntax parsed with `ast` and checked against a whitelist. Nothing is ever run.

Allowed: symbol names, integer literals, + - * // %, unary -/+, comparisons (chained too), and/or/not, min/max,
parentheses. Arithmetic yields numbers, comparisons and and/or/not yield conditions; a constraint is a condition.
"""

from __future__ import annotations

import ast
import difflib
import re
from dataclasses import dataclass

from kiln.errors import KilnError

RUNTIME_SYMBOLS = ("num_tokens", "batch_size", "seq_len")
MODEL_SYMBOLS = (
    "hidden_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "num_layers",
    "num_experts",
    "top_k",
)
SYMBOLS = RUNTIME_SYMBOLS + MODEL_SYMBOLS
MAX_LENGTH = 1000
MAX_DEPTH = 64

ARITHMETIC = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.FloorDiv: "//", ast.Mod: "%"}
COMPARISONS = (ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE)
FUNCTIONS = ("min", "max")
_REJECTED_OPS = {
    ast.Div: ("/", "'/' is true division; use '//' for integer division"),
    ast.Pow: ("**", "'**' is not supported; write the product out with '*'"),
}
_NAMES = {
    ast.Attribute: "attribute access",
    ast.Subscript: "indexing",
    ast.Lambda: "lambda",
    ast.IfExp: "conditional expressions",
    ast.NamedExpr: "':=' assignment",
    ast.List: "lists",
    ast.Tuple: "tuples",
    ast.Dict: "dicts",
    ast.Set: "sets",
    ast.JoinedStr: "f-strings",
    ast.ListComp: "comprehensions",
    ast.GeneratorExp: "comprehensions",
    ast.Starred: "'*' unpacking",
}
_ASSIGNMENT = re.compile(r"(?<![<>=!:])=(?!=)")


class ExprError(KilnError):
    """A constraint kiln cannot accept; `offset` is the 0-based character position in the constraint text."""

    def __init__(self, message: str, offset: int = 0, length: int = 1) -> None:
        super().__init__(message)
        self.message, self.offset, self.length = message, offset, max(length, 1)


@dataclass(frozen=True)
class Expr:
    """A parsed, whitelisted constraint. `text` is as written; `tree` is its validated `ast` expression."""

    text: str
    tree: ast.expr
    symbols: frozenset[str]

    @property
    def normalized(self) -> str:
        """Canonical spelling (spacing and redundant parentheses removed), for hashing."""
        return ast.unparse(self.tree)

    def offset_of(self, node: ast.AST) -> int:
        return _offset(self.text, node)


def parse_constraint(text: str) -> Expr:
    """Parse and check one constraint; raise ExprError pointing at the offending character."""
    if len(text) > MAX_LENGTH:
        raise ExprError(f"constraint too long ({len(text)} characters, at most {MAX_LENGTH})")
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as exc:
        raise _syntax_error(text, exc) from None
    except (ValueError, RecursionError, MemoryError) as exc:  # null bytes, absurd nesting
        raise ExprError(f"syntax error: {exc or type(exc).__name__}") from None
    lead = len(text) - len(text.lstrip())
    expr = Expr(text, tree, frozenset())
    checker = _Checker(text, lead)
    if checker.kind(tree, 0) != "bool":
        shown = ast.unparse(tree)
        raise ExprError(
            f"`{shown}` is a number, not a condition; compare it, e.g. `{shown} <= 2048`", lead, len(text.strip())
        )
    return Expr(expr.text, tree, frozenset(checker.names))


def _syntax_error(text: str, exc: SyntaxError) -> ExprError:
    stripped = text.strip()
    lead = len(text) - len(text.lstrip())
    match = _ASSIGNMENT.search(stripped)
    if match is not None:
        fixed = stripped[: match.start()] + "==" + stripped[match.end() :]
        return ExprError(f"'=' assigns; use '==' to compare: `{fixed}`", lead + match.start())
    if not exc.offset:  # NOTE: CPython reports offset 0 when the text ends mid-expression, e.g. `seq_len <`
        return ExprError("syntax error: the constraint ends too early", max(len(text.rstrip()) - 1, 0))
    offset = lead + _line_start(stripped, exc.lineno or 1) + exc.offset - 1
    reason = "" if exc.msg == "invalid syntax" else f": {exc.msg}"
    return ExprError(f"syntax error{reason}", min(offset, max(len(text) - 1, 0)))


class _Checker:
    """Walks the tree, rejecting anything off the whitelist; returns each node's kind ("int" or "bool")."""

    def __init__(self, text: str, lead: int) -> None:
        self.text, self.lead = text, lead
        self.names: set[str] = set()

    def fail(self, message: str, node: ast.AST, length: int | None = None) -> ExprError:
        start = _offset(self.text, node, self.lead)
        if length is None:
            end = _end_offset(self.text, node, self.lead)
            length = end - start if end > start else 1
        return ExprError(message, start, length)

    def kind(self, node: ast.AST, depth: int) -> str:
        if depth > MAX_DEPTH:
            raise self.fail(f"constraint nested too deeply (more than {MAX_DEPTH} levels)", node)
        if isinstance(node, ast.Constant):
            if isinstance(node.value, int) and not isinstance(node.value, bool):
                return "int"
            raise self.fail(f"only integer literals are allowed, found {node.value!r}", node)
        if isinstance(node, ast.Name):
            if node.id not in SYMBOLS:
                hint = difflib.get_close_matches(node.id, [*SYMBOLS, *FUNCTIONS], n=1, cutoff=0.6)
                why = f"did you mean '{hint[0]}'?" if hint else f"known symbols: {', '.join(SYMBOLS)}"
                raise self.fail(f"unknown symbol '{node.id}'; {why}", node, len(node.id))
            self.names.add(node.id)
            return "int"
        if isinstance(node, ast.BinOp):
            return self.binop(node, depth)
        if isinstance(node, ast.UnaryOp):
            return self.unary(node, depth)
        if isinstance(node, ast.Compare):
            for op in node.ops:
                if not isinstance(op, COMPARISONS):
                    raise self.fail(f"'{_op_text(op)}' is not allowed; compare with == != < <= > >=", node)
            for operand in (node.left, *node.comparators):
                self.expect(operand, "int", depth, "comparisons compare numbers, not conditions")
            return "bool"
        if isinstance(node, ast.BoolOp):
            word = "and" if isinstance(node.op, ast.And) else "or"
            for value in node.values:
                self.expect(value, "bool", depth, f"'{word}' joins conditions, found a number")
            return "bool"
        if isinstance(node, ast.Call):
            return self.call(node, depth)
        what = _NAMES.get(type(node), f"'{type(node).__name__}' syntax")
        raise self.fail(
            f"{what} not allowed in a constraint; allowed: names, integers, + - * // %, "
            "comparisons, and/or/not, min/max, parentheses",
            node,
        )

    def expect(self, node: ast.AST, kind: str, depth: int, message: str) -> None:
        if self.kind(node, depth + 1) != kind:
            raise self.fail(f"{message}: `{ast.unparse(node)}`", node)

    def binop(self, node: ast.BinOp, depth: int) -> str:
        op_type = type(node.op)
        if op_type not in ARITHMETIC:
            symbol, message = _REJECTED_OPS.get(
                op_type, (_op_text(node.op), f"operator '{_op_text(node.op)}' is not allowed; use + - * // %")
            )
            raise self._at_operator(node, symbol, message)
        for side in (node.left, node.right):
            self.expect(side, "int", depth, f"'{ARITHMETIC[op_type]}' needs numbers, found a condition")
        return "int"

    def _at_operator(self, node: ast.BinOp, symbol: str, message: str) -> ExprError:
        start = _end_offset(self.text, node.left, self.lead)
        found = self.text.find(symbol, start)
        return ExprError(message, found if found >= 0 else _offset(self.text, node, self.lead), len(symbol))

    def unary(self, node: ast.UnaryOp, depth: int) -> str:
        if isinstance(node.op, ast.Not):
            self.expect(node.operand, "bool", depth, "'not' needs a condition, found a number")
            return "bool"
        if isinstance(node.op, (ast.USub, ast.UAdd)):
            self.expect(node.operand, "int", depth, "unary minus needs a number, found a condition")
            return "int"
        raise self.fail("operator '~' is not allowed; use + - * // %", node, 1)

    def call(self, node: ast.Call, depth: int) -> str:
        if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
            shown = ast.unparse(node.func)
            raise self.fail(f"calls are not allowed (found `{shown}(...)`); only min(...) and max(...)", node.func)
        if node.keywords or len(node.args) < 2:
            raise self.fail(f"{node.func.id}() takes two or more numbers, e.g. {node.func.id}(num_tokens, 2048)", node)
        for arg in node.args:
            self.expect(arg, "int", depth, f"{node.func.id}() takes numbers, found a condition")
        return "int"


def _line_start(text: str, lineno: int) -> int:
    lines = text.split("\n")
    return sum(len(line) + 1 for line in lines[: max(lineno - 1, 0)])


def _char_col(line: str, byte_col: int) -> int:
    """ast columns count UTF-8 bytes; diagnostics count characters."""
    return len(line.encode()[:byte_col].decode(errors="ignore"))


def _offset(text: str, node: ast.AST, lead: int | None = None) -> int:
    stripped = text.strip()
    lead = len(text) - len(text.lstrip()) if lead is None else lead
    lineno, col = getattr(node, "lineno", 1), getattr(node, "col_offset", 0)
    line = stripped.split("\n")[lineno - 1] if lineno - 1 < len(stripped.split("\n")) else ""
    return lead + _line_start(stripped, lineno) + _char_col(line, col)


def _end_offset(text: str, node: ast.AST, lead: int) -> int:
    stripped = text.strip()
    lineno, col = getattr(node, "end_lineno", None), getattr(node, "end_col_offset", None)
    if lineno is None or col is None:
        return _offset(text, node, lead)
    line = stripped.split("\n")[lineno - 1] if lineno - 1 < len(stripped.split("\n")) else ""
    return lead + _line_start(stripped, lineno) + _char_col(line, col)


def _op_text(op: ast.AST) -> str:
    names = {
        ast.In: "in",
        ast.NotIn: "not in",
        ast.Is: "is",
        ast.IsNot: "is not",
        ast.BitAnd: "&",
        ast.BitOr: "|",
        ast.BitXor: "^",
        ast.LShift: "<<",
        ast.RShift: ">>",
        ast.MatMult: "@",
    }
    return names.get(type(op), type(op).__name__)
