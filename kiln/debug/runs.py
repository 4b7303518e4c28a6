"""One debug request at a time through an engine, as a path's run (kiln.debug.session): the checks that it fits,
teacher forcing, speculative decoding's two passes, and a cached prefix primed first.

- Speculation: every path verifies the reference's own tokens as drafts (a teacher-forced request's drafts are its
  given tokens, kiln.engine.speculation.speculation), so each step's rows are tokens kept; an unforced run first finds
  its greedy tokens (the same with drafts or without), then runs forced to them.
- `cached_prefix` N: the prompt's first N tokens are computed by an earlier request (its prefill alone), so the
  run's own prefill finds them in the prefix cache and computes only the rest over that context, on every path:
  the prefill over a cached prefix is what the diff holds to the reference. The cache is emptied before each run,
  so no run finds another's blocks.
- `lora`: every request (the priming one too) runs with that adapter, registered with the engine on first use.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kiln.debug.taps import LOGITS, StepRecord, TapRecorder
from kiln.engine.core import EngineCore
from kiln.engine.sampling.sampling_params import SamplingParams
from kiln.errors import ConfigError
from kiln.lora.request import LoRARequest


@dataclass
class PathRun:
    """What one path computed for one sequence: per step, each boundary's rows (real tokens only)."""

    path: str
    steps: list[dict[str, torch.Tensor]]
    tokens: list[int]  # the path's own greedy choice at every step
    input_ids: list[int]  # the tokens fed, flattened over steps
    positions: list[int]
    step_rows: list[int] = field(default_factory=list)  # tokens per step: the prompt, then 1 per decode (k + 1 per
    # verification of k drafts, with speculative decoding)
    logit_rows: list[int] = field(default_factory=list)  # logits rows per step: 1, or k + 1 for a verification

    @classmethod
    def from_steps(cls, path: str, records: list[StepRecord]) -> PathRun:
        return cls(
            path=path,
            steps=[r.values for r in records],
            tokens=[int(t) for r in records for t in r.values[LOGITS].argmax(-1)],
            input_ids=[t for r in records for t in r.input_ids],
            positions=[p for r in records for p in r.positions],
            step_rows=[len(r.input_ids) for r in records],
            logit_rows=[len(r.values[LOGITS]) for r in records],
        )

    def boundary(self, name: str) -> torch.Tensor:
        return torch.cat([s[name] for s in self.steps])


class DebugRuns:
    """Runs one greedy debug request at a time through an engine; `recorder` holds the taps of its steps; `lora`:
    the adapter every request runs with (None: the base model)."""

    def __init__(self, recorder: TapRecorder, cached_prefix: int = 0, lora: LoRARequest | None = None) -> None:
        self.recorder, self.cached_prefix, self.lora = recorder, cached_prefix, lora
        self._request_ids = itertools.count()

    def generate(
        self, path: str, engine: EngineCore, prompt: Sequence[int], num_decode: int, forced: Sequence[int] | None
    ) -> PathRun:
        """Prefill `prompt` then decode `num_decode` tokens through `engine`, feeding `forced` tokens when given."""
        self._check(engine, prompt, num_decode, forced)
        if forced is None and engine.speculator is not None:
            # the greedy tokens, for the forced run
            forced = self._tokens(path, engine, prompt, num_decode=num_decode, forced=None)
        self._tokens(path, engine, prompt, num_decode=num_decode, forced=forced)
        return PathRun.from_steps(path, self.recorder.take())

    def _check(self, engine: EngineCore, prompt: Sequence[int], num_decode: int, forced: Sequence[int] | None) -> None:
        total = len(prompt) + num_decode + 1
        if engine.pool.blocks_for(total) > engine.pool.num_blocks:
            raise ConfigError(
                f"the debug run needs {total} tokens of KV cache but the engine holds "
                f"{engine.pool.num_blocks * engine.pool.block_size}; use a shorter prompt, fewer decode steps, "
                "or more --num-kv-blocks"
            )
        max_tokens = engine.config.scheduler.max_num_batched_tokens
        if len(prompt) > max_tokens:
            raise ConfigError(
                f"the debug prompt has {len(prompt)} tokens but one step takes at most {max_tokens}: a debug run "
                "prefills in one step; raise --max-num-batched-tokens"
            )
        if forced is not None and len(forced) < num_decode:
            raise ConfigError(f"teacher forcing needs {num_decode} tokens, got {len(forced)}")
        if self.cached_prefix:
            block = engine.pool.block_size
            if engine.scheduler.prefix is None:
                raise ConfigError("--cached-prefix needs prefix caching, which this model's engine turned off")
            if self.cached_prefix % block or not 0 < self.cached_prefix < len(prompt):
                raise ConfigError(
                    f"--cached-prefix {self.cached_prefix}: expected a multiple of the KV block size ({block}) "
                    f"shorter than the prompt ({len(prompt)} tokens): the cache holds whole blocks"
                )

    def _tokens(
        self, path: str, engine: EngineCore, prompt: Sequence[int], num_decode: int, forced: Sequence[int] | None
    ) -> list[int]:
        """One greedy request of `num_decode` + 1 tokens through `engine`, after the cached prefix is primed; its
        output tokens (the taps recording its steps alone)."""
        if self.cached_prefix:
            engine.reset_prefix_cache(quiet=True)
            self._run(engine, f"debug-{path}-prefix-{next(self._request_ids)}", prompt[: self.cached_prefix], 0)
        self.recorder.take()
        request_id = f"debug-{path}-{next(self._request_ids)}"
        return self._run(engine, request_id, prompt, num_decode=num_decode, forced=forced)

    def _run(
        self,
        engine: EngineCore,
        request_id: str,
        prompt: Sequence[int],
        num_decode: int,
        forced: Sequence[int] | None = None,
    ) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=num_decode + 1, ignore_eos=True)
        forced_output = list(forced) if forced is not None else None
        engine.add_request(request_id, list(prompt), params, forced_output, lora=self.lora)
        tokens: list[int] = []
        try:
            while engine.has_unfinished:
                for out in engine.step():
                    tokens = out.token_ids if out.request_id == request_id else tokens
        finally:
            engine.abort(request_id)
        return list(tokens)
