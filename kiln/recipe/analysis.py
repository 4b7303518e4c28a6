"""Solver-backed findings: conflicts (minimal unsat cores with lines), redundant constraints, a witness and the
maximum of each run-time symbol."""

from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import dataclass, field

from kiln.recipe.constraints import CONSTRAINTS_PATH, Constraint
from kiln.recipe.diagnostics import Diagnostic
from kiln.recipe.evaluate import evaluate_node
from kiln.recipe.expr import MODEL_SYMBOLS, RUNTIME_SYMBOLS, ExprError
from kiln.recipe.solver import ConstraintSystem, Fact, SolverBudget, describe_core
from kiln.recipe.source import SourceDoc


@dataclass(frozen=True)
class Analysis:
    system: ConstraintSystem
    satisfiable: bool
    witness: dict[str, int] = field(default_factory=dict)
    bounds: dict[str, int | None] = field(default_factory=dict)
    diagnostics: list[Diagnostic] = field(default_factory=list)


def analyze(
    doc: SourceDoc,
    constraints: list[Constraint],
    model_values: Mapping[str, int] | None,
    budget: SolverBudget | None = None,
) -> Analysis:
    """Prove the constraints consistent. Model-only constraints are left to the checkpoint check when the model
    is known; constraints that divide by a zero are reported here and kept out of the solver."""
    zero = _zero_divisors(doc, constraints, model_values or {})
    diagnostics = list(zero.values())
    solved = [c for c in constraints if not (model_values and c.is_model_only) and c.index not in zero]
    system = ConstraintSystem(solved, model_values, budget=budget)
    outcome = system.check()
    if outcome.status == "unsat":
        first = next((f.constraint for f in sorted(outcome.core, key=_line) if f.constraint), None)
        message = describe_core(outcome.core, system.model_values)
        at = (
            doc.at("error", message, line=first.line, col=first.col, length=len(first.text))
            if first
            else doc.diagnostic("error", message, CONSTRAINTS_PATH)
        )
        return Analysis(system, False, diagnostics=[*diagnostics, at])
    if outcome.status == "unknown":
        message = (
            f"could not prove the constraints consistent within {system.timeout_ms / 1000:g} s "
            f"(Z3: {outcome.reason}); simplify products or divisions of two symbols"
        )
        return Analysis(system, False, diagnostics=[*diagnostics, doc.diagnostic("error", message, CONSTRAINTS_PATH)])
    diagnostics += _redundant(doc, system)
    bounds = {name: system.maximum(name, outcome.witness[name]) for name in RUNTIME_SYMBOLS}
    return Analysis(system, True, witness=outcome.witness, bounds=bounds, diagnostics=diagnostics)


def _line(fact: Fact) -> int:
    return fact.constraint.line if fact.constraint else 0


def _redundant(doc: SourceDoc, system: ConstraintSystem) -> list[Diagnostic]:
    """Warn about each constraint the others imply. Later ones are checked first, so of two equivalent
    constraints the later one is reported and the earlier one kept."""
    implicit = [f for f in system.facts if f.constraint is None]
    active = [f for f in system.facts if f.constraint is not None]
    diagnostics = []
    for fact in reversed(list(active)):
        c = fact.constraint
        others = [f for f in active if f is not fact]
        reasons = system.implied_by(fact, [*implicit, *others])
        if reasons is None:
            continue
        active.remove(fact)
        by = [f.label for f in reasons if f.constraint is not None]
        why = f"it is implied by {' and '.join(by)}" if by else "it is always true"
        diagnostics.append(
            doc.at("warning", f"redundant constraint {c.text}: {why}", line=c.line, col=c.col, length=len(c.text))
        )
    return diagnostics


def _zero_divisors(doc: SourceDoc, constraints: list[Constraint], values: Mapping[str, int]) -> dict[int, Diagnostic]:
    """A divisor made of literals and model symbols that is 0 is a division by zero on every run (by index)."""
    diagnostics: dict[int, Diagnostic] = {}
    for c in constraints:
        for node in ast.walk(c.expr.tree):
            if not (isinstance(node, ast.BinOp) and isinstance(node.op, (ast.FloorDiv, ast.Mod))):
                continue
            names = {n.id for n in ast.walk(node.right) if isinstance(n, ast.Name)}
            if not names <= set(MODEL_SYMBOLS) or not names <= set(values):
                continue
            try:
                divisor = evaluate_node(c.expr, node.right, values)
            except ExprError:
                continue  # the inner division is reported on its own
            if divisor == 0:
                shown = ast.unparse(node.right)
                given = ", ".join(f"{n}={values[n]}" for n in sorted(names))
                line, col = c.position_of(node.right)
                message = f"division by zero in {c.text}: `{shown}` is 0" + (f" ({given})" if given else "")
                diagnostics.setdefault(c.index, doc.at("error", message, line=line, col=col, length=len(shown)))
    return diagnostics
