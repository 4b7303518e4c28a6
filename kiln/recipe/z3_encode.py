"""Translate a whitelisted constraint to Z3, exactly: Python's floor `//` and `%` (not Z3's Euclidean ones), and
the division-by-zero error as a definedness condition that respects short-circuit evaluation."""

from __future__ import annotations

import ast
import itertools
from collections.abc import Mapping
from dataclasses import dataclass

import z3

from kiln.recipe.expr import Expr

_fresh = itertools.count()


@dataclass(frozen=True)
class Encoded:
    """`formula` holds exactly when Python evaluates the constraint to True without raising. `axioms` define the
    fresh quotient/remainder variables; assert them unconditionally (never negate them) wherever `formula` is used."""

    formula: z3.BoolRef
    axioms: tuple[z3.BoolRef, ...]


def encode(expr: Expr, symbols: Mapping[str, z3.ArithRef]) -> Encoded:
    encoder = _Encoder(symbols)
    value, defined = encoder.run(expr.tree)
    return Encoded(z3.And(defined, value), tuple(encoder.axioms))


class _Encoder:
    def __init__(self, symbols: Mapping[str, z3.ArithRef]) -> None:
        self.symbols = symbols
        self.axioms: list[z3.BoolRef] = []

    def run(self, node: ast.expr) -> tuple[z3.ExprRef, z3.BoolRef]:
        """(value, defined): `defined` is false where Python would raise ZeroDivisionError."""
        if isinstance(node, ast.Constant):
            return z3.IntVal(node.value), z3.BoolVal(True)
        if isinstance(node, ast.Name):
            return self.symbols[node.id], z3.BoolVal(True)
        if isinstance(node, ast.BinOp):
            return self.binop(node)
        if isinstance(node, ast.UnaryOp):
            value, defined = self.run(node.operand)
            if isinstance(node.op, ast.Not):
                return z3.Not(value), defined
            return (-value if isinstance(node.op, ast.USub) else value), defined
        if isinstance(node, ast.BoolOp):
            return self.boolop(node)
        if isinstance(node, ast.Compare):
            return self.compare(node)
        if isinstance(node, ast.Call):
            pairs = [self.run(arg) for arg in node.args]
            value = pairs[0][0]
            for other, _ in pairs[1:]:
                value = (
                    z3.If(other < value, other, value) if node.func.id == "min" else z3.If(other > value, other, value)
                )
            return value, z3.And(*[d for _, d in pairs])
        raise ValueError(f"not a whitelisted node: {ast.dump(node)}")

    def binop(self, node: ast.BinOp) -> tuple[z3.ExprRef, z3.BoolRef]:
        (a, da), (b, db) = self.run(node.left), self.run(node.right)
        defined = z3.And(da, db)
        if isinstance(node.op, ast.Add):
            return a + b, defined
        if isinstance(node.op, ast.Sub):
            return a - b, defined
        if isinstance(node.op, ast.Mult):
            return a * b, defined
        # NOTE: Python: a == b*q + r with r in [0, b) for b > 0 and in (b, 0] for b < 0 (floor division).
        n = next(_fresh)
        q, r = z3.Int(f"__q{n}"), z3.Int(f"__r{n}")
        self.axioms.append(
            z3.Implies(
                b != 0,
                z3.And(
                    a == b * q + r,
                    z3.Implies(b > 0, z3.And(r >= 0, r < b)),
                    z3.Implies(b < 0, z3.And(b < r, r <= 0)),
                ),
            )
        )
        return (q if isinstance(node.op, ast.FloorDiv) else r), z3.And(defined, b != 0)

    def boolop(self, node: ast.BoolOp) -> tuple[z3.ExprRef, z3.BoolRef]:
        is_and = isinstance(node.op, ast.And)
        pairs = [self.run(v) for v in node.values]
        # Operand i runs only if every earlier operand was true (and) / false (or).
        defined, reached = [], z3.BoolVal(True)
        for value, d in pairs:
            defined.append(z3.Implies(reached, d))
            reached = z3.And(reached, value if is_and else z3.Not(value))
        values = [v for v, _ in pairs]
        return (z3.And(*values) if is_and else z3.Or(*values)), z3.And(*defined)

    def compare(self, node: ast.Compare) -> tuple[z3.ExprRef, z3.BoolRef]:
        ops = {
            ast.Eq: lambda x, y: x == y,
            ast.NotEq: lambda x, y: x != y,
            ast.Lt: lambda x, y: x < y,
            ast.LtE: lambda x, y: x <= y,
            ast.Gt: lambda x, y: x > y,
            ast.GtE: lambda x, y: x >= y,
        }
        left, defined = self.run(node.left)
        definedness, results, reached = [defined], [], z3.BoolVal(True)
        for op, comparator in zip(node.ops, node.comparators, strict=True):
            right, d = self.run(comparator)
            definedness.append(z3.Implies(reached, d))  # a chain stops at its first false comparison
            result = ops[type(op)](left, right)
            results.append(result)
            reached = z3.And(reached, result)
            left = right
        return z3.And(*results), z3.And(*definedness)
