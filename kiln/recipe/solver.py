"""The constraint system in Z3: one tracked assertion per constraint, minimal unsat cores, implied constraints,
maxima of the run-time symbols. Every query runs under a timeout and all of them share one budget per validation
(SolverBudget); "unknown" is never mistaken for "proven"."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import z3

from kiln.errors import KilnError
from kiln.recipe.constraints import Constraint
from kiln.recipe.expr import MODEL_SYMBOLS, RUNTIME_SYMBOLS, SYMBOLS
from kiln.recipe.z3_encode import encode

DEFAULT_TIMEOUT_MS = 2000
DEFAULT_BUDGET_S = 10.0
# NOTE: a bound above 2**62 is "unbounded" for every purpose kiln has (token counts, page counts).
UNBOUNDED = 2**62


class SolverBudgetExceeded(KilnError):
    """Every Z3 query of one validation together ran past the budget."""


class SolverBudget:
    """Wall-clock seconds all the Z3 queries of one validation may take together; each query's timeout is the
    smaller of its own and what is left, so a recipe validates in about the same time every run."""

    def __init__(self, seconds: float = DEFAULT_BUDGET_S) -> None:
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds

    def timeout_ms(self, per_query_ms: int) -> int:
        left = int((self.deadline - time.monotonic()) * 1000)
        if left <= 0:
            raise SolverBudgetExceeded(f"the solver's budget of {self.seconds:g} s for this validation ran out")
        return min(per_query_ms, left)


@dataclass(frozen=True)
class Fact:
    """A tracked assertion: a recipe constraint (`constraint` set) or a fact kiln adds (implicit bound, query)."""

    key: str
    formula: z3.BoolRef
    label: str
    constraint: Constraint | None = None


@dataclass(frozen=True)
class Outcome:
    status: str  # "sat" | "unsat" | "unknown"
    witness: dict[str, int]
    core: tuple[Fact, ...] = ()
    reason: str = ""


class ConstraintSystem:
    """The recipe's constraints over integer symbols. Model symbols are constants when the checkpoint is known;
    the run-time symbols (and unknown model symbols) are positive integers."""

    def __init__(
        self,
        constraints: Sequence[Constraint],
        model_values: Mapping[str, int] | None,
        timeout_ms: int = DEFAULT_TIMEOUT_MS,
        budget: SolverBudget | None = None,
    ) -> None:
        self.timeout_ms = timeout_ms
        self.budget = budget or SolverBudget()
        self.model_values = dict(model_values or {})
        self.vars = {name: z3.Int(name) for name in SYMBOLS if name not in self.model_values}
        scope = {**self.vars, **{k: z3.IntVal(v) for k, v in self.model_values.items()}}
        self.axioms: list[z3.BoolRef] = []
        self.facts: list[Fact] = []
        for name, var in self.vars.items():
            why = "counts are positive" if name in RUNTIME_SYMBOLS else "a model dimension"
            self.facts.append(Fact(f"implicit:{name}", var >= 1, f"the implicit bound {name} >= 1 ({why})"))
        for c in constraints:
            encoded = encode(c.expr, scope)
            self.axioms.extend(encoded.axioms)
            self.facts.append(Fact(f"c{c.index}", encoded.formula, c.label, c))

    def symbol(self, name: str) -> z3.ArithRef:
        return self.vars[name]

    def check(self, facts: Sequence[Fact] | None = None, extra: Sequence[Fact] = ()) -> Outcome:
        """Check `facts` (default: all) plus `extra`; an unsat answer carries a minimal core."""
        tracked = [*(self.facts if facts is None else facts), *extra]
        status, witness, core, reason = self._solve(tracked)
        if status != "unsat":
            return Outcome(status, witness, reason=reason)
        return Outcome("unsat", {}, self._minimize(core))

    def implied_by(self, target: Fact, others: Sequence[Fact]) -> tuple[Fact, ...] | None:
        """The facts among `others` that imply `target` (empty: always true), or None if not (provably) implied."""
        negation = Fact(f"not:{target.key}", z3.Not(target.formula), f"not {target.label}")
        outcome = self.check(others, [negation])
        if outcome.status != "unsat":
            return None
        return tuple(f for f in outcome.core if f is not negation)

    def maximum(self, name: str, start: int) -> int | None:
        """Largest feasible value of a symbol (None: unbounded or undecided); `start` must be feasible."""
        solver = self._solver(self.facts)
        var = self.vars[name]
        if self._query(solver, var > UNBOUNDED) != z3.unsat:
            return None
        low, high = start, UNBOUNDED
        while low < high:
            mid = (low + high + 1) // 2
            solver.push()
            solver.add(var >= mid)
            result = self._run(solver)
            found = solver.model().eval(var, model_completion=True).as_long() if result == z3.sat else None
            solver.pop()
            if result == z3.unknown:
                return None
            low, high = (found, high) if found is not None else (low, mid - 1)
        return low

    def _query(self, solver: z3.Solver, formula: z3.BoolRef) -> z3.CheckSatResult:
        solver.push()
        solver.add(formula)
        result = self._run(solver)
        solver.pop()
        return result

    def _run(self, solver: z3.Solver) -> z3.CheckSatResult:
        """One check under the per-query timeout, cut to what is left of the budget; raises once it is spent."""
        solver.set("timeout", self.budget.timeout_ms(self.timeout_ms))
        result = solver.check()
        if result == z3.unknown:
            self.budget.timeout_ms(self.timeout_ms)  # raises when the budget, not the query, ran out
        return result

    def _solver(self, facts: Sequence[Fact]) -> z3.Solver:
        solver = z3.Solver()
        solver.add(*self.axioms)
        solver.add(*[f.formula for f in facts])
        return solver

    def _solve(self, facts: Sequence[Fact]) -> tuple[str, dict[str, int], list[Fact], str]:
        solver = z3.Solver()
        solver.add(*self.axioms)
        by_name = {}
        for fact in facts:
            tracker = z3.Bool(f"track:{fact.key}")
            by_name[str(tracker)] = fact
            solver.assert_and_track(fact.formula, tracker)
        result = self._run(solver)
        if result == z3.sat:
            model = solver.model()
            witness = {n: model.eval(v, model_completion=True).as_long() for n, v in self.vars.items()}
            return "sat", witness, [], ""
        if result == z3.unsat:
            return "unsat", {}, [by_name[str(t)] for t in solver.unsat_core()], ""
        return "unknown", {}, [], solver.reason_unknown()

    def _minimize(self, core: list[Fact]) -> tuple[Fact, ...]:
        """Deletion-based minimisation: drop each member whose removal keeps the set unsatisfiable."""
        kept = list(core)
        for fact in list(core):
            trial = [f for f in kept if f is not fact]
            if trial and self._solve(trial)[0] == "unsat":
                kept = trial
        return tuple(kept)


def describe_core(core: Sequence[Fact], model_values: Mapping[str, int]) -> str:
    """`seq_len <= 2048 (line 9) conflicts with seq_len >= 4096 (line 10)` for a minimal unsat core."""
    members = sorted(core, key=lambda f: (f.constraint is None, f.constraint.line if f.constraint else 0))
    labels = [f.label for f in members]
    if len(labels) == 1:
        text = f"{labels[0]} can never hold"
    else:
        text = f"{labels[0]} conflicts with {' and '.join(labels[1:])}"
    used = sorted({s for f in members if f.constraint for s in f.constraint.expr.symbols} & set(MODEL_SYMBOLS))
    shown = [f"{s}={model_values[s]}" for s in used if s in model_values]
    return text + (f" (the model has {', '.join(shown)})" if shown else "")
