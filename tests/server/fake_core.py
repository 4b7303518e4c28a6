"""EngineCore's serving surface without a model, for fast in-process tests of the async engine and the API.

Each step gives every request the token `token_id` (the one for "x"); `gate` (cleared) holds the engine thread
inside `step` so tests can keep requests in flight; `fail_next_step` makes one step raise; `loop_failure` (set)
kills the engine loop on its next turn. Prompts containing "VIOLATE" are rejected with a RecipeViolation, as the
engine's recipe guards do; prompts containing "CRASH" raise an IndexError, as a kiln bug would. The tokenizer
counts its calls, so tests can tell that a request was refused before tokenizing.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from kiln.config import EngineConfig, SchedulerConfig
from kiln.engine.request import RequestMetrics, RequestOutput
from kiln.engine.sampling.sampling_params import SamplingParams
from kiln.engine.scheduling.kv_cache import BlockPool
from kiln.errors import RequestError, WorkerFailure
from kiln.recipe.guards import RecipeViolation

TOKEN_X = ord("x")


class FakeTokenizer:
    """One token per character (its code point mod 256); decoding a token id past Unicode's range raises;
    `gate` (cleared) holds every encode, so tests can keep requests in tokenization."""

    eos_token_id = 0
    chat_template = None
    template_knows_tools = False  # tools reach the prompt by kiln's fallback (kiln/server/tool_prompt.py)
    template_variables: frozenset[str] = frozenset()
    special_token_texts: tuple[str, ...] = ()
    vocab_size = 256
    tokenizer_class = "FakeTokenizer"
    bos_token, eos_token, pad_token = None, "\x00", None

    def __init__(self) -> None:
        self.num_encode_calls = 0
        self.num_template_calls = 0
        self.gate = threading.Event()
        self.gate.set()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.num_encode_calls += 1
        self.gate.wait(timeout=30)
        return [ord(c) % 256 for c in text]

    def encode_as_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.encode(text, add_special_tokens)  # no special tokens: text is always text

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def token_strs(self, ids: list[int]) -> list[str]:
        return [chr(i) for i in ids]

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Any = None,
        template_kwargs: Any = None,
    ) -> str:
        self.num_template_calls += 1
        turns = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return turns + ("<assistant>" if add_generation_prompt else "")

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Any = None,
        template_kwargs: Any = None,
    ) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools, template_kwargs))


@dataclass
class FakeRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    block_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=time.monotonic()))

    def output(self, finished: bool, reason: str | None, num_new: int) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=None,
            prompt_token_ids=self.prompt_token_ids,
            text="x" * len(self.output_token_ids),
            token_ids=list(self.output_token_ids),
            finished=finished,
            finish_reason=reason,
            delta="x" if num_new else "",
            num_new_tokens=num_new,
            logprobs=[{t: -0.5} for t in self.output_token_ids] if self.params.logprobs is not None else None,
            metrics=self.metrics,
        )


class FakeCore:
    def __init__(
        self,
        max_num_seqs: int = 4,
        num_blocks: int = 64,
        block_size: int = 4,
        max_model_len: int = 64,
        tokenizer: Any = None,
    ):
        self.config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=max_num_seqs))
        self.tokenizer = tokenizer or FakeTokenizer()
        self.max_model_len = max_model_len
        self.checkpoint_path = "/models/fake-model"
        self.model_config = SimpleNamespace(name="fake-model", vocab_size=256)
        self.pool = BlockPool(num_blocks, block_size)
        self.scheduler = SimpleNamespace(running=[], waiting=[], num_preemptions=0, prefix=None)
        self.speculator = None
        self.runner = SimpleNamespace(counters=SimpleNamespace(replays=7, dynamic_fallbacks=2))
        self.requests: dict[str, FakeRequest] = {}
        self.grammars = None  # its fake tokens follow no grammar: structured outputs are refused
        self.lora = None  # no LoRA adapters (kiln.server.adapters)
        self.num_steps = 0
        self.gate = threading.Event()
        self.gate.set()
        self.fail_next_step = False
        self.loop_failure: Exception | None = None
        self.workers = None  # a single-device engine
        self.worker_failure: str | None = None  # set: check_alive raises, as when another rank died
        self.token_id = TOKEN_X
        self.step_delay = 0.002  # seconds per step, like a (very) small model
        self.priorities: dict[str, int] = {}  # each request's, as the server passed it
        self.groups: dict[str, str | None] = {}  # each request's client request (n > 1), as the server passed it

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        group: str | None = None,
        lora: object = None,
    ) -> FakeRequest:
        assert lora is None, "the fake core serves no LoRA adapters"
        self.priorities[request_id] = priority
        self.groups[request_id] = group
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        text = self.tokenizer.decode(ids)
        if "CRASH" in text:
            raise IndexError("index 1000000000 is out of bounds for dimension 0 with size 256")
        if "VIOLATE" in text:
            raise RecipeViolation(
                f"recipe.yaml:9: seq_len <= 32 violated: got seq_len={len(ids) + params.max_tokens}",
                "recipe.yaml",
                9,
                request_id,
                "seq_len",
            )
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise RequestError(f"{total} tokens exceed max_model_len={self.max_model_len}", request_id, "max_tokens")
        req = FakeRequest(request_id, ids, params, self.pool.allocate(self.pool.blocks_for(total)))
        self.requests[request_id] = req
        self.scheduler.running.append(request_id)
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self._finish(request_id)
        return None if req is None else req.output(True, "abort", 0)

    def check_alive(self) -> None:
        if self.worker_failure is not None:
            raise WorkerFailure(self.worker_failure)

    @property
    def has_unfinished(self) -> bool:
        if self.loop_failure is not None:
            raise self.loop_failure
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self.gate.wait(timeout=30)
        time.sleep(self.step_delay)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("boom in the fake model")
        outputs = []
        now = time.monotonic()
        for req in list(self.requests.values()):
            req.output_token_ids.append(self.token_id)
            req.metrics.first_token_time = req.metrics.first_token_time or now
            finished = len(req.output_token_ids) >= req.params.max_tokens
            if finished:
                req.metrics.finished_time = now
                self._finish(req.request_id)
            outputs.append(req.output(finished, "length" if finished else None, 1))
        self.num_steps += 1
        return outputs

    def _finish(self, request_id: str) -> FakeRequest | None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.pool.free(req.block_ids)
            self.scheduler.running.remove(request_id)
        return req
