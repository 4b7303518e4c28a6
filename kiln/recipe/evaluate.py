"""Evaluate a whitelisted constraint on integers with Python's own semantics (floor `//`, sign-of-divisor `%`)."""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Mapping

from kiln.recipe.expr import Expr, ExprError

_ARITHMETIC: dict[type, Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_COMPARE: dict[type, Callable[[int, int], bool]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
}


def evaluate(expr: Expr, values: Mapping[str, int]) -> bool:
    """Whether the constraint holds for `values`; ExprError for a division by zero or a missing symbol."""
    return compile_expr(expr)(values)


def evaluate_node(expr: Expr, node: ast.expr, values: Mapping[str, int]) -> int | bool:
    """Value of one sub-expression of `expr` (used to find divisors that are zero for a given model)."""
    return _compile(expr, node)(values)


Compiled = Callable[[Mapping[str, int]], "int | bool"]


def compile_expr(expr: Expr) -> Callable[[Mapping[str, int]], bool]:
    """The constraint as a closure over `values`, built once from its whitelisted tree (never `eval`); the run-time
    guards build it once and call it on every step, `evaluate` builds it for one call."""
    run = _compile(expr, expr.tree)
    return lambda values: bool(run(values))


def _compile(expr: Expr, node: ast.expr) -> Compiled:
    if isinstance(node, ast.Constant):
        value = node.value
        return lambda values: value
    if isinstance(node, ast.Name):
        name, offset = node.id, expr.offset_of(node)

        def lookup(values: Mapping[str, int]) -> int:
            if name not in values:
                raise ExprError(f"no value for '{name}'", offset, len(name))
            return values[name]

        return lookup
    if isinstance(node, ast.BinOp):
        left, right, op = _compile(expr, node.left), _compile(expr, node.right), _ARITHMETIC[type(node.op)]
        if not isinstance(node.op, (ast.FloorDiv, ast.Mod)):
            return lambda values: op(left(values), right(values))
        message, offset = f"division by zero: `{ast.unparse(node.right)}` is 0", expr.offset_of(node.right)

        def divide(values: Mapping[str, int]) -> int:
            a, b = left(values), right(values)
            if b == 0:
                raise ExprError(message, offset)
            return op(a, b)

        return divide
    if isinstance(node, ast.UnaryOp):
        operand = _compile(expr, node.operand)
        unary = {ast.Not: operator.not_, ast.USub: operator.neg, ast.UAdd: operator.pos}[type(node.op)]
        return lambda values: unary(operand(values))
    if isinstance(node, ast.BoolOp):
        parts = [_compile(expr, v) for v in node.values]
        if isinstance(node.op, ast.And):
            return lambda values: all(bool(p(values)) for p in parts)
        return lambda values: any(bool(p(values)) for p in parts)
    if isinstance(node, ast.Compare):
        operands = [_compile(expr, node.left)] + [_compile(expr, c) for c in node.comparators]
        ops = [_COMPARE[type(op)] for op in node.ops]

        def compare(values: Mapping[str, int]) -> bool:
            left = operands[0](values)
            for op, operand in zip(ops, operands[1:], strict=True):
                right = operand(values)
                if not op(left, right):
                    return False
                left = right
            return True

        return compare
    if isinstance(node, ast.Call):
        args = [_compile(expr, a) for a in node.args]
        pick = min if node.func.id == "min" else max
        return lambda values: pick(a(values) for a in args)
    raise ExprError(f"cannot evaluate `{ast.unparse(node)}`", expr.offset_of(node))
