"""A request's life in the engine, and the plain output objects handed to callers."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from kiln.engine.sampling.sampling_params import SamplingParams
from kiln.engine.structured.structured_output import GrammarState
from kiln.lora.request import LoRARequest


@dataclass(frozen=True)
class Logprob:
    """One token's logprob at a prompt position and its rank there (1: the likeliest), as vLLM's `Logprob`."""

    logprob: float
    rank: int


# per prompt position: {token id: Logprob}, the actual token first, then the likeliest; None at position 0
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class PooledSum:
    """The fp32 sum (on the host) of a request's pooled rows so far, over positions [position, position + count)."""

    position: int
    total: torch.Tensor
    count: int


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass(frozen=True)
class RequestOptions:
    """How the engine holds a request beside its sampling parameters, fixed when the request is made.

    `forced_output`: teacher forcing (the debugger): these tokens are fed back instead of the sampled ones, so two
    execution paths see the same inputs (the sampled tokens are still what the step computed); `priority`: the
    scheduling policy `priority` admits lower values first and preempts higher ones first (vLLM's); `group`: the
    client request this sequence belongs to (its prompts x n share one), for the scheduler's per-request cap on
    running sequences (None: a request of its own); `keeps_probs`: a draft engine's sampled request keeps the
    distribution each token was drawn from (kiln.engine.speculation.draft); `lora`: the LoRA adapter it runs with
    (kiln.lora; None: the base model): its rows use the adapter's slot and its prefix-cache blocks are keyed on it."""

    forced_output: tuple[int, ...] | None = None
    priority: int = 0
    group: str | None = None
    keeps_probs: bool = False
    lora: LoRARequest | None = None


class Request:
    """Token state of one sequence. The scheduler moves it between queues; only the runner reads its blocks."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        generator: torch.Generator | None,
        options: RequestOptions | None = None,
    ) -> None:
        options = options or RequestOptions()
        self.request_id = request_id
        self.priority = options.priority
        self.forced_output = list(options.forced_output) if options.forced_output is not None else None
        self.prompt = prompt
        self.group = options.group
        self.lora = options.lora
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        # NOTE: its seed alone is used: each output position draws from its own generator (`generator_at`)
        self.generator = generator
        self.output_token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] = []
        # each prompt position's logprobs so far (kiln.engine.running.prompt_logprobs: None for the first token), when
        # asked
        self.prompt_logprobs: PromptLogprobs | None = [None] if params.prompt_logprobs is not None else None
        # an embedding request's pooled rows so far (kiln.engine.running.pooling), and its vector once its prompt is
        # computed
        self.pooled: PooledSum | None = None
        self.embedding: list[float] | None = None
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # per block pool (kiln.engine.scheduling.scheduler.BlockGroup): every layer's blocks, then a hybrid model's
        # sliding layers' own; each maps the sequence's logical blocks in order (released ones hold the pool's null
        # block)
        self.block_tables: list[list[int]] = [[], []]
        # prefix caching (kiln.engine.scheduling.prefix_cache): the keys of the sequence's full blocks, computed once
        # each, and the cache serials of the blocks it holds that are full and registered (or found cached), in order
        self.block_keys: list[object] = []
        self.block_serials: list[int] = []
        self.num_cached_tokens: int | None = None  # prompt tokens found cached when first admitted (caching on)
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        # the request field whose content failed it (its grammar, kiln.engine.output.updater): the client's error, not
        # the engine's
        self.error_param: str | None = None
        self.metrics = RequestMetrics(arrival_time=time.monotonic())
        self.grammar: GrammarState | None = None  # its place in its structured output's grammar (Admission sets it)
        # a draft engine's sampled request: the distribution each sampled token was drawn from, which the draft
        # model hands the target's verification as its q
        self.keeps_probs = options.keeps_probs
        self.sampled_probs: list[torch.Tensor] = []

    def generator_at(self, position: int) -> torch.Generator | None:
        """The generator of output position `position` (None: greedy): seeded by the request's seed and the
        position alone, so a token's draw never depends on how many draws came before it. With speculative
        decoding, whether a step verified drafts then changes nothing: the same seed gives the same text."""
        if self.generator is None:
            return None
        return torch.Generator().manual_seed(position_seed(self.generator.initial_seed(), position))

    @property
    def block_ids(self) -> list[int]:
        """The blocks of every layer's pool (a hybrid model's global layers')."""
        return self.block_tables[0]

    @block_ids.setter
    def block_ids(self, blocks: list[int]) -> None:
        self.block_tables[0] = blocks

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def lora_id(self) -> int | None:
        return self.lora.lora_int_id if self.lora is not None else None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asks for prompt logprobs and some positions are not scored yet."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED


@dataclass
class RequestOutput:
    """What a caller sees of a request after a step: the text so far (`delta` is this step's new text)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None
    delta: str = ""
    num_new_tokens: int = 0
    logprobs: list[dict[int, float]] | None = None
    # asked for (SamplingParams.prompt_logprobs): per prompt position, None first (vLLM's RequestOutput field)
    prompt_logprobs: PromptLogprobs | None = None
    # an embedding request's vector (SamplingParams.embed), set in its final output
    embedding: list[float] | None = None
    error: str | None = None
    error_param: str | None = None  # set: the request's own field made it fail (a grammar), a client error
    num_cached_tokens: int = 0  # prompt tokens it found in the prefix cache (usage.prompt_tokens_details)
    lora_name: str | None = None  # the LoRA adapter it ran with (None: the base model)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=time.monotonic()))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def position_seed(seed: int, position: int) -> int:
    """A 63-bit seed for output `position` of a request seeded `seed`: splitmix64's finalizer over both, so
    neighbouring positions (and seeds) get unrelated streams."""
    mask = (1 << 64) - 1
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) >> 1
