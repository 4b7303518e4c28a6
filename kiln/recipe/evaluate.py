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
    return bool(_Evaluator(expr, values).run(expr.tree))


class _Evaluator:
    def __init__(self, expr: Expr, values: Mapping[str, int]) -> None:
        self.expr, self.values = expr, values

    def run(self, node: ast.expr) -> int | bool:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in self.values:
                raise ExprError(f"no value for '{node.id}'", self.expr.offset_of(node), len(node.id))
            return self.values[node.id]
        if isinstance(node, ast.BinOp):
            left, right = self.run(node.left), self.run(node.right)
            if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
                raise ExprError(f"division by zero: `{ast.unparse(node.right)}` is 0", self.expr.offset_of(node.right))
            return _ARITHMETIC[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp):
            value = self.run(node.operand)
            return {ast.Not: operator.not_, ast.USub: operator.neg, ast.UAdd: operator.pos}[type(node.op)](value)
        if isinstance(node, ast.BoolOp):
            is_and = isinstance(node.op, ast.And)
            for value in node.values:  # short-circuits exactly like Python
                if bool(self.run(value)) != is_and:
                    return not is_and
            return is_and
        if isinstance(node, ast.Compare):
            left = self.run(node.left)
            for op, comparator in zip(node.ops, node.comparators, strict=True):
                right = self.run(comparator)
                if not _COMPARE[type(op)](left, right):
                    return False
                left = right
            return True
        if isinstance(node, ast.Call):
            args = [self.run(arg) for arg in node.args]
            return min(args) if node.func.id == "min" else max(args)
        raise ExprError(f"cannot evaluate `{ast.unparse(node)}`", self.expr.offset_of(node))


def evaluate_node(expr: Expr, node: ast.expr, values: Mapping[str, int]) -> int | bool:
    """Value of one sub-expression of `expr` (used to find divisors that are zero for a given model)."""
    return _Evaluator(expr, values).run(node)
