"""Run-time enforcement of a recipe's constraints. A violation fails only the request (or step) that broke it and
names the recipe line: `recipe.yaml:9: seq_len <= 2048 violated: got seq_len=4096 (request 3)`.

Each constraint is compiled once into a closure over its symbols (kiln.recipe.evaluate.compile_expr), so the
per-step check costs a few microseconds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from kiln.errors import RequestError
from kiln.recipe.constraints import Constraint
from kiln.recipe.evaluate import compile_expr
from kiln.recipe.expr import RUNTIME_SYMBOLS, ExprError

STEP_SYMBOLS = frozenset({"num_tokens", "batch_size"})


class RecipeViolation(RequestError):
    """A request or step that breaks a recipe constraint; `file`/`line` locate the constraint."""

    def __init__(
        self, message: str, file: str, line: int, request_id: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message, request_id=request_id, param=param)
        self.file, self.line = file, line


class RecipeGuards:
    """Evaluates the recipe's constraints on concrete values (compiled closures, never `eval`).

    Rules: `check_request` checks the constraints over seq_len (and model symbols) only, for every length the
    sequence passes through; `check_step` checks those over num_tokens/batch_size on the step's padded shape,
    and, when `seq_lens` is given, the constraints that mix seq_len with them, once per sequence. Constraints
    over model symbols alone were settled when the recipe was loaded.
    """

    def __init__(self, file: str, constraints: Sequence[Constraint], model_values: Mapping[str, int]) -> None:
        self.file = file
        self.model_values = dict(model_values)
        runtime = [c for c in constraints if c.runtime_symbols]
        self.request_constraints = [c for c in runtime if c.runtime_symbols == {"seq_len"}]
        self.step_constraints = [c for c in runtime if c.runtime_symbols <= STEP_SYMBOLS]
        self.mixed_constraints = [c for c in runtime if "seq_len" in c.runtime_symbols and len(c.runtime_symbols) > 1]
        self._compiled: dict[int, Callable[[Mapping[str, int]], bool]] = {
            c.index: compile_expr(c.expr) for c in runtime
        }

    def check_request(self, request_id: str, seq_len: int, first: int | None = None, span: int | None = None) -> None:
        """Raise RecipeViolation unless every length from `first` (the prompt; default `seq_len`) to `seq_len`
        (prompt + max new tokens) satisfies the seq_len constraints: a request that would break one mid-way is
        refused up front rather than failed later. `span` (the engine's max_model_len) caps the lengths looked at,
        so a huge max_tokens costs no more than a valid request; longer ones are refused by that limit anyway."""
        start = first or seq_len
        end = seq_len if span is None else min(seq_len, start + span)
        for c in self.request_constraints:
            for length in range(start, end + 1):
                if not self._holds(c, {"seq_len": length}, request_id):
                    self._violated(c, {"seq_len": length}, request_id)

    def step_allows(self, num_tokens: int, batch_size: int) -> bool:
        """Whether a step of this (padded) shape satisfies every num_tokens/batch_size constraint."""
        values = {**self.model_values, "num_tokens": num_tokens, "batch_size": batch_size}
        return all(self._call(c, values, None) for c in self.step_constraints)

    def check_step(self, num_tokens: int, batch_size: int, seq_lens: Sequence[int] = ()) -> None:
        """Raise RecipeViolation if a scheduled step (its padded token and sequence counts) breaks the recipe."""
        values = {"num_tokens": num_tokens, "batch_size": batch_size}
        for c in self.step_constraints:
            if not self._holds(c, values, None):
                self._violated(c, values, None)
        for seq_len in seq_lens:
            for c in self.mixed_constraints:
                each = {**values, "seq_len": seq_len}
                if not self._holds(c, each, None):
                    self._violated(c, each, None)

    def violated_step_constraints(self, num_tokens: int, batch_size: int) -> list[Constraint]:
        values = {"num_tokens": num_tokens, "batch_size": batch_size}
        return [c for c in self.step_constraints if not self._holds(c, values, None)]

    def _holds(self, c: Constraint, values: dict[str, int], request_id: str | None) -> bool:
        return self._call(c, {**self.model_values, **values}, request_id)

    def _call(self, c: Constraint, values: Mapping[str, int], request_id: str | None) -> bool:
        try:
            return self._compiled[c.index](values)
        except ExprError as exc:
            got = _got(c, values)
            raise RecipeViolation(
                f"{self.file}:{c.line}: {c.text} cannot be evaluated: {exc.message} (got {got})",
                self.file,
                line=c.line,
                request_id=request_id,
                param=_param(c),
            ) from None

    def _violated(self, c: Constraint, values: Mapping[str, int], request_id: str | None) -> None:
        message = f"{self.file}:{c.line}: {c.text} violated: got {_got(c, values)}"
        raise RecipeViolation(message, self.file, line=c.line, request_id=request_id, param=_param(c))


def _got(c: Constraint, values: Mapping[str, int]) -> str:
    return ", ".join(f"{name}={values[name]}" for name in RUNTIME_SYMBOLS if name in c.runtime_symbols)


def _param(c: Constraint) -> str:
    return ",".join(name for name in RUNTIME_SYMBOLS if name in c.runtime_symbols)
