"""Run-time enforcement of a recipe's constraints. A violation fails only the request (or step) that broke it and
names the recipe line: `recipe.yaml:9: seq_len <= 2048 violated: got seq_len=4096 (request 3)`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kiln.errors import RequestError
from kiln.recipe.constraints import Constraint
from kiln.recipe.evaluate import evaluate
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
    """Evaluates the recipe's constraints on concrete values with the whitelist evaluator (never `eval`).

    Rules: `check_request` checks every constraint over seq_len (and model symbols) only; `check_step` checks
    those over num_tokens/batch_size only, and, when `seq_lens` is given, the constraints that mix seq_len with
    them, once per sequence. Constraints over model symbols alone were settled when the recipe was loaded.
    """

    def __init__(self, file: str, constraints: Sequence[Constraint], model_values: Mapping[str, int]) -> None:
        self.file = file
        self.model_values = dict(model_values)
        runtime = [c for c in constraints if c.runtime_symbols]
        self.request_constraints = [c for c in runtime if c.runtime_symbols == {"seq_len"}]
        self.step_constraints = [c for c in runtime if c.runtime_symbols <= STEP_SYMBOLS]
        self.mixed_constraints = [c for c in runtime if "seq_len" in c.runtime_symbols and len(c.runtime_symbols) > 1]

    def check_request(self, request_id: str, seq_len: int) -> None:
        """Raise RecipeViolation if a request of `seq_len` total tokens (prompt + max new tokens) breaks the recipe."""
        for c in self.request_constraints:
            self._check(c, {"seq_len": seq_len}, request_id)

    def check_step(self, num_tokens: int, batch_size: int, seq_lens: Sequence[int] = ()) -> None:
        """Raise RecipeViolation if a scheduled step (its token and sequence counts) breaks the recipe."""
        values = {"num_tokens": num_tokens, "batch_size": batch_size}
        for c in self.step_constraints:
            self._check(c, values, None)
        for seq_len in seq_lens:
            for c in self.mixed_constraints:
                self._check(c, {**values, "seq_len": seq_len}, None)

    def _check(self, c: Constraint, values: dict[str, int], request_id: str | None) -> None:
        got = ", ".join(f"{name}={values[name]}" for name in RUNTIME_SYMBOLS if name in c.runtime_symbols)
        where = f"{self.file}:{c.line}: {c.text}"
        try:
            holds = evaluate(c.expr, {**self.model_values, **values})
        except ExprError as exc:
            raise RecipeViolation(
                f"{where} cannot be evaluated: {exc.message} (got {got})", self.file, c.line, request_id, _param(c)
            ) from None
        if not holds:
            raise RecipeViolation(f"{where} violated: got {got}", self.file, c.line, request_id, _param(c))


def _param(c: Constraint) -> str:
    return ",".join(name for name in RUNTIME_SYMBOLS if name in c.runtime_symbols)
