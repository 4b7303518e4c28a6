"""Speculative decoding's settings (`SpeculativeConfig`, held by `kiln.config.EngineConfig`): which proposer, how
many draft tokens, the n-gram lookup range, the policy and the draft model. Plain data, no torch, as kiln.config.
"""

from __future__ import annotations

from dataclasses import dataclass

SPECULATIVE_METHODS = (
    "ngram",
    "draft",
)  # proposers of speculative decoding (kiln.engine.speculation.speculation, .draft)
SPECULATIVE_POLICIES = ("measured", "always")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer guesses up to `num_speculative_tokens` next tokens of a decoding sequence and
    the target verifies them in its next step (kiln.engine.speculation.speculation). `method` None: off."""

    method: str | None = None
    num_speculative_tokens: int = 4
    # n-gram / prompt lookup: the longest and shortest suffix of the sequence searched for earlier in it (vLLM's names)
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # which proposals a step verifies: "measured" (those that raise tokens per second by the step costs timed here)
    # or "always" (every one)
    policy: str = "measured"
    # draft: the smaller model (a .gguf file, an HF directory or "default") proposing the tokens; same vocabulary
    draft_model: str | None = None

    @property
    def is_enabled(self) -> bool:
        return self.method is not None

    def __str__(self) -> str:
        if not self.is_enabled:
            return "off"
        if self.method == "draft":
            proposer = f"draft model {self.draft_model}"
        else:
            proposer = f"ngram, lookup {self.prompt_lookup_min}-{self.prompt_lookup_max}"
        return f"{proposer}, {self.num_speculative_tokens} tokens, {self.policy}"

    def problem(self) -> str | None:
        """What makes these settings contradict each other (None: nothing), worded for a flag or a recipe field."""
        if self.prompt_lookup_min > self.prompt_lookup_max:
            return f"prompt_lookup_min {self.prompt_lookup_min} is above prompt_lookup_max {self.prompt_lookup_max}"
        if self.method == "draft" and not self.draft_model:
            return "the draft method needs a draft model (--speculative-model, or the recipe's draft_model)"
        if self.method != "draft" and self.draft_model:
            return f"a draft model ({self.draft_model}) is only used by the draft method, not by {self.method or 'off'}"
        return None

    def capture_sizes(self, sizes: tuple[int, ...]) -> tuple[int, ...]:
        """`sizes` and, for each, that many sequences verifying k drafts (k+1 decode rows each), so a batch where
        every sequence brings k drafts replays a captured size unpadded."""
        rows = self.num_speculative_tokens + 1
        return tuple(sorted(set(sizes) | {s * rows for s in sizes})) if self.is_enabled else sizes
