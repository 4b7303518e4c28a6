"""Per-request sampling parameters, validated on construction with errors naming the field.

Bounds are OpenAI's where it has them (temperature [0, 2], penalties [-2, 2], logprobs <= 20) and otherwise
keep every row's arithmetic finite: a temperature below TEMPERATURE_EPS samples greedily (dividing logits by
1e-45 overflows to inf), and the repetition penalty is bounded so that penalised logits stay finite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kiln.engine.structured.constraint import StructuredOutput
from kiln.errors import RequestError

TEMPERATURE_EPS = 1e-5  # below this a temperature is greedy (vLLM's rule too)
INT64 = (-(2**63), 2**63 - 1)
MAX_LOGIT_BIAS = 1024  # entries per request: each costs the sampler an index per step


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 (or below TEMPERATURE_EPS) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # applied to prompt and output tokens (HF/vLLM semantics)
    presence_penalty: float = 0.0  # OpenAI semantics, output tokens only
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # number of top alternatives to return per token (0 = only the chosen token)
    # the prompt tokens' logprobs (kiln.engine.running.prompt_logprobs), with this many top alternatives per position
    # (vLLM's prompt_logprobs); such a request computes its whole prompt (it reads nothing from the prefix cache)
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_output: StructuredOutput | None = None  # the output held to a schema, regex, choice or grammar
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit (OpenAI: -100..100)
    # prefix caching: only requests with the same salt share cached KV blocks (vLLM's cache_salt), so one tenant
    # cannot time another's cache hits; None: the shared cache
    cache_salt: str | None = None
    # an embedding (kiln.engine.running.pooling): prefill only, the answer is the prompt's pooled final hidden state
    # (RequestOutput.embedding); it samples nothing, so max_tokens and the sampling fields do not apply, and it reads
    # nothing from the prefix cache
    embed: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.logit_bias = dict(self.logit_bias)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise RequestError(f"invalid sampling parameter {name}={value!r}: must be a finite number", param=name)
        if 0.0 < self.temperature < TEMPERATURE_EPS:
            self.temperature = 0.0
        checks = [
            ("max_tokens", self.max_tokens >= 1, "must be >= 1"),
            ("temperature", 0.0 <= self.temperature <= 2.0, "must be in [0, 2]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= -1, "must be -1, 0 (disabled) or a positive count"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("repetition_penalty", 0.01 <= self.repetition_penalty <= 100.0, "must be in [0.01, 100]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens, "must be in [0, max_tokens]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be in [0, 20]"),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                "must be in [0, 20]",
            ),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            ("stop_token_ids", all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "must be token ids"),
            ("seed", self.seed is None or INT64[0] <= self.seed <= INT64[1], "must fit in a signed 64-bit integer"),
            (
                "logit_bias",
                len(self.logit_bias) <= MAX_LOGIT_BIAS
                and all(isinstance(t, int) and t >= 0 for t in self.logit_bias)
                and all(isinstance(b, (int, float)) and -100 <= b <= 100 for b in self.logit_bias.values()),
                f"must map at most {MAX_LOGIT_BIAS} token ids to biases in [-100, 100]",
            ),
            (
                "structured_output",
                self.structured_output is None or isinstance(self.structured_output, StructuredOutput),
                "must be a kiln.StructuredOutput",
            ),
            ("cache_salt", self.cache_salt is None or isinstance(self.cache_salt, str), "must be a string"),
            (
                "embed",
                not self.embed
                or (self.logprobs is None and self.prompt_logprobs is None and self.structured_output is None),
                "an embedding samples nothing: it takes no logprobs, prompt_logprobs or structured_output",
            ),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise RequestError(f"invalid sampling parameter {name}={getattr(self, name)!r}: {rule}", param=name)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
