"""How many prompt tokens one request prefills in a step while others stream: a budget of cost, not of tokens.

A chunk of c prompt tokens starting at context s costs its weight products (c token's worth) plus its attention,
which grows with the context: c x (s + c / 2) context positions, each `1 / attention_tokens` of a token's products
(`attention_tokens`: the context at which a token's attention costs as much as its products, from the model's
shapes, `attention_tokens_of`). So cost(c, s) = c x (1 + (s + c / 2) / attention_tokens), in tokens at context 0.
With 512 tokens a chunk, an 8,000-token prompt's last chunks cost ~3.5x its first, and every stream's next token
waited for them (gaps of 13 s on a shared 2-core machine).

The budget is `long_prefill_token_threshold` tokens at context 0, and, once steps have been timed, at most
`long_prefill_step_seconds` of measured time. A step takes a fixed time (its decode rows, the weights read once),
averaged over the steps that prefill nothing, plus its chunks' cost times the seconds per unit of cost, averaged over
the steps that prefill (their time less the fixed part: counting it per unit would shrink small chunks further and
further; a step's cost is its chunks' alone, the fixed part holding its decode rows). The measured time bounds a chunk
only while a sequence decodes beside it (prompts that arrive together, none decoding, take the token threshold: no
stream's gap to keep short). Until a step with a chunk has been timed, a chunk beside a decoding sequence is a probe of
`PROBE_TOKENS`, the smallest chunk: an untimed budget of 512 tokens made a first chunk of 1.8 s on a 2-core AVX2
machine, and a probe of 64 tokens still took 0.3-0.5 s there, every stream's gap. From the probe on, a chunk costs at
most `GROWTH` times the costliest step timed so far, so one noisy early sample cannot size a chunk far past what was
seen (chunks double to the budget in a few steps). The chunk is the largest whose cost fits the smallest budget, so it
shrinks as its context grows and as the machine is slower, but never below a step's fixed time (where the target cannot
be met, a prompt still prefills at half speed or better). Counted: `num_shrunk` chunks cut below the threshold.
"""

from __future__ import annotations

import math

from kiln.config import ModelConfig

COST_EMA = 0.2  # weight of the newest step in the seconds-per-cost average
MIN_CHUNK = 16  # the smallest chunk, so a prompt always advances by something
MIN_TIMED_COST = float(MIN_CHUNK)  # steps cheaper than this (a short prompt's few tokens) are not timed
PROBE_TOKENS = MIN_CHUNK  # a chunk before any was timed: its step is timed (its cost is at least MIN_TIMED_COST)
GROWTH = 2.0  # a chunk costs at most this many times the costliest step timed so far


def attention_tokens_of(model: ModelConfig) -> float:
    """The context at which one token's attention (QK and PV over every layer) costs as much as its weight
    products: the products' multiply-adds per layer over 2 x heads x head_dim per context position."""
    h, kv = model.hidden_size, model.num_kv_heads * model.head_dim
    q = model.num_heads * model.head_dim
    products = h * q + 2 * h * kv + q * h + 3 * h * model.intermediate_size
    return products / (2 * model.num_heads * model.head_dim)


class PrefillBudget:
    def __init__(self, max_tokens: int, attention_tokens: float | None, step_seconds: float) -> None:
        """`max_tokens`: the most tokens a chunk takes (0: no cap); `attention_tokens`: see the module docstring
        (None: attention is free, the budget is in tokens); `step_seconds`: the longest a step with a chunk should
        take, once measured (0: steps are not timed: a pipeline's loop, which launches steps without waiting)."""
        self.max_tokens, self.attention_tokens, self.step_seconds = max_tokens, attention_tokens, step_seconds
        self.seconds_per_cost: float | None = None
        self.base_seconds = 0.0  # a step's time without a chunk
        self.largest_timed = 0.0  # the costliest step timed so far
        self.num_shrunk = 0

    def cost(self, num_new: int, start: int) -> float:
        """The cost of prefilling `num_new` tokens after `start` computed ones, in tokens at context 0."""
        if self.attention_tokens is None:
            return float(num_new)
        return num_new * (1 + (start + num_new / 2) / self.attention_tokens)

    def chunk(self, wanted: int, start: int, timed: bool = True) -> int:
        """The tokens of `wanted` a request with `start` tokens computed prefills this step; `timed`: the measured
        step time bounds it too (while a sequence decodes beside it; else the token threshold's cost alone)."""
        budget = self.cost(self.max_tokens, 0) if self.max_tokens else math.inf
        timed = timed and bool(self.step_seconds)
        if timed and self.seconds_per_cost is None:
            return min(wanted, PROBE_TOKENS)
        if timed and self.seconds_per_cost:
            # NOTE: a chunk gets at least a step's fixed time: below it the fixed part dominates and the prompt's
            # prefill slows down more than the others' gaps shrink (where the target cannot be met at all)
            chunk_seconds = max(self.step_seconds - self.base_seconds, self.base_seconds)
            budget = min(budget, chunk_seconds / self.seconds_per_cost, GROWTH * self.largest_timed)
        if self.cost(wanted, start) <= budget:
            return wanted
        chunk = max(MIN_CHUNK, self._largest_within(budget, start))
        if chunk < self.max_tokens:
            self.num_shrunk += 1
        return min(chunk, wanted)

    def observe(self, cost: float, seconds: float) -> None:
        """A step whose chunks cost `cost` (0: it prefilled nothing) took `seconds`."""
        if seconds <= 0:
            return
        if cost == 0:
            self.base_seconds += COST_EMA * (seconds - self.base_seconds)
            return
        if cost < MIN_TIMED_COST:
            return
        self.largest_timed = max(self.largest_timed, cost)
        rate = max(seconds - self.base_seconds, seconds / 4) / cost
        old = self.seconds_per_cost
        self.seconds_per_cost = rate if old is None else old + COST_EMA * (rate - old)

    def _largest_within(self, budget: float, start: int) -> int:
        """The largest c with cost(c, start) <= budget: the root of c^2 / 2K + c (1 + s / K) = budget."""
        k = self.attention_tokens
        if k is None:
            return int(budget)
        b = 1 + start / k
        return int(k * (math.sqrt(b * b + 2 * budget / k) - b))
