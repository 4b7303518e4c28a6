"""The shape of each step under a recipe's step constraints, as a graph compiler would enforce them.

A step of `n` real tokens from `b` sequences runs as `(num_tokens, batch_size)` with num_tokens >= n and
batch_size >= b: padding sequences (one padding token each, which attention ignores and never caches) and padding
tokens are added until every constraint over num_tokens and batch_size holds, choosing the fewest padded tokens.
The executor's own padding (`pad_to`, its captured sizes) is part of the search, so the size that really runs is
the one checked. The allowed num_tokens values of each batch size are found once, on first use, by the recipe's
compiled constraints; shapes are memoised per (n, b).

Without a recipe (or one with no step constraints) a step is `(pad_to(n), b)`.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

from kiln.config import EngineConfig
from kiln.recipe.guards import RecipeGuards, RecipeViolation

Shape = tuple[int, int]  # (num_tokens, batch_size) a step runs with
MAX_SHAPES = 4096  # (num_tokens, batch_size) pairs whose shape is remembered


class StepShaper:
    def __init__(
        self, guards: RecipeGuards | None, pad_to: Callable[[int], int], max_num_tokens: int, max_batch_size: int
    ) -> None:
        self.guards = guards if guards is not None and (guards.step_constraints or guards.mixed_constraints) else None
        self.shapes = guards is not None and bool(guards.step_constraints)  # else a step is (pad_to(n), b)
        self.pad_to = pad_to
        self.max_num_tokens, self.max_batch_size = max_num_tokens, max_batch_size
        self._shapes: dict[tuple[int, int], Shape | None] = {}  # (n, b) -> shape; an lru_cache over a bound method
        # would hold this object in a reference cycle, and with it the executor whose pad_to it holds
        self._allowed_by_batch: dict[int, tuple[list[int], frozenset[int]]] = {}

    @classmethod
    def for_engine(cls, config: EngineConfig, pad_to: Callable[[int], int]) -> StepShaper:
        """Step shapes under the engine's recipe constraints: padding may grow a step up to the recipe's bounds."""
        sched, recipe = config.scheduler, config.recipe
        bounds = recipe.bounds if recipe is not None else {}
        max_batch = bounds.get("batch_size") or sched.max_num_seqs
        max_tokens = bounds.get("num_tokens") or sched.max_num_batched_tokens + max_batch
        return cls(recipe.guards if recipe is not None else None, pad_to, max_tokens, max_batch)

    def check(self, num_tokens: int, batch_size: int, seq_lens: list[int]) -> Shape:
        """The shape a step of these real counts runs with, checked against every step constraint (and, per
        sequence, those mixing seq_len in); RecipeViolation naming the recipe line when none exists."""
        shape = self.shape(num_tokens, batch_size)
        if self.guards is None:
            return self.pad_to(num_tokens), batch_size
        if shape is None:
            assert self.shapes
            broken = self.guards.violated_step_constraints(num_tokens, batch_size) or self.guards.step_constraints
            file = self.guards.file
            message = (
                f"no step shape the recipe allows holds {num_tokens} tokens of {batch_size} sequences (padding up "
                f"to num_tokens={self.max_num_tokens}, batch_size={self.max_batch_size}): "
                + "; ".join(f"{file}:{c.line}: {c.text}" for c in broken)
            )
            raise RecipeViolation(message, file, broken[0].line)
        self.guards.check_step(*shape, seq_lens)
        return shape

    def check_admission(self, request_id: str, prompt_len: int, chunked: bool) -> None:
        """Refuse up front a request whose prompt no allowed step can take: not even alone, chunked if allowed."""
        if not self.shapes:
            return
        first = min(prompt_len, self.max_num_tokens)
        if self.largest_fit(0, 1, first) if chunked else self.fits(prompt_len, 1):
            return
        try:
            self.check(prompt_len if not chunked else 1, 1, [])
        except RecipeViolation as exc:
            raise RecipeViolation(
                message=f"the prompt ({prompt_len} tokens) can never be scheduled: {exc}",
                file=exc.file,
                line=exc.line,
                request_id=request_id,
                param="prompt",
            ) from None

    def fits(self, num_tokens: int, batch_size: int) -> bool:
        """Whether a step of this many real tokens and sequences can be padded to an allowed shape."""
        return self.shape(num_tokens, batch_size) is not None

    def largest_fit(self, before: int, batch_size: int, wanted: int) -> int:
        """The most tokens (<= wanted) a new chunk may add to a step of `before` tokens so that the step, with
        `batch_size` sequences, still has an allowed shape; 0 if none."""
        for k in range(wanted, 0, -1):
            if self.fits(before + k, batch_size):
                return k
        return 0

    def shape(self, n: int, b: int) -> Shape | None:
        """`_shape(n, b)`, remembered (up to MAX_SHAPES pairs: a step's counts repeat)."""
        key = (n, b)
        if key not in self._shapes:
            if len(self._shapes) >= MAX_SHAPES:
                self._shapes.clear()
            self._shapes[key] = self._shape(n, b)
        return self._shapes[key]

    def _shape(self, n: int, b: int) -> Shape | None:
        if not self.shapes:
            return self.pad_to(n), b
        best: Shape | None = None
        for batch in range(b, self.max_batch_size + 1):
            need = n + batch - b  # each padding sequence brings one padding token
            if best is not None and need >= best[0]:
                break
            num_tokens = self._smallest_run(need, batch)
            if num_tokens is not None and (best is None or num_tokens < best[0]):
                best = (num_tokens, batch)
        return best

    def _smallest_run(self, need: int, batch: int) -> int | None:
        """The smallest allowed num_tokens >= need that the executor runs as is (pad_to keeps it)."""
        allowed = self._allowed(batch)
        i = bisect.bisect_left(allowed, need)
        while i < len(allowed):
            ran = self.pad_to(allowed[i])
            if ran == allowed[i] or ran in self._allowed_set(batch):
                return ran
            i = bisect.bisect_left(allowed, ran, lo=i + 1)  # pad_to jumped: continue from where it landed
        return None

    def _allowed(self, batch: int) -> list[int]:
        """Sorted num_tokens values the step constraints allow with `batch` sequences (computed once)."""
        if batch not in self._allowed_by_batch:
            assert self.guards is not None
            values = [t for t in range(1, self.max_num_tokens + 1) if self.guards.step_allows(t, batch)]
            self._allowed_by_batch[batch] = (values, frozenset(values))
        return self._allowed_by_batch[batch][0]

    def _allowed_set(self, batch: int) -> frozenset[int]:
        self._allowed(batch)
        return self._allowed_by_batch[batch][1]
