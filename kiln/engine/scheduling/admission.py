"""`Admission`: a client's prompt and sampling parameters checked and turned into a `Request`.

It tokenizes text prompts, checks token ids against the vocabulary, the length against `max_model_len`, the
recipe's request guards and step shapes, and the KV cache's capacity, and gives every sampled request its seeded
generator. It never touches engine state: a refused request raises `RequestError` naming the request and the field.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

import torch

from kiln.engine.request import Request, RequestOptions
from kiln.engine.sampling.sampling_params import SamplingParams
from kiln.engine.scheduling.step_shape import StepShaper
from kiln.engine.structured.structured_output import Grammars
from kiln.errors import RequestError
from kiln.model.tokenizer import KilnTokenizer


class Admission:
    def __init__(
        self,
        tokenizer: KilnTokenizer | None,
        vocab_size: int,
        max_model_len: int,
        recipe: Any,
        shaper: StepShaper,
        chunked_prefill: bool,
        blocks_short: Callable[[int], tuple[int, int] | None],
        seed: int | None,
        grammars: Grammars | None = None,
        multi_device: bool = False,
    ) -> None:
        """`blocks_short(total)`: (blocks needed, blocks the cache holds) when `total` tokens cannot fit at once;
        `grammars`: the engine's compiled structured outputs (None: the model has no tokenizer, so none);
        `multi_device`: a tensor- or pipeline-parallel engine, which does not compute prompt logprobs."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.recipe = recipe
        self.shaper = shaper
        self.chunked_prefill = chunked_prefill
        self.blocks_short = blocks_short
        self._seed_rng = torch.Generator().manual_seed(seed if seed is not None else secrets.randbits(63))
        self.grammars = grammars
        self.multi_device = multi_device

    def make_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, options: RequestOptions | None = None
    ) -> Request:
        """A checked `Request` (RequestError naming the field otherwise), held as `options` say."""
        ids, text = self._prompt_ids(request_id, prompt)
        vocab = self.vocab_size
        bad_stops = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad_stops:
            raise RequestError(
                f"stop token id {bad_stops[0]} is outside the vocabulary [0, {vocab})", request_id, "stop_token_ids"
            )
        bad_bias = [t for t in params.logit_bias if t >= vocab]
        if bad_bias:
            raise RequestError(
                f"logit_bias token id {bad_bias[0]} is outside the vocabulary [0, {vocab})", request_id, "logit_bias"
            )
        if params.prompt_logprobs is not None and self.multi_device:
            raise RequestError(
                "prompt logprobs (prompt_logprobs, or echo with logprobs) are computed on a single device only; "
                "this engine is tensor or pipeline parallel: serve the model on one device to score prompts",
                request_id,
                "prompt_logprobs",
            )
        if params.embed and self.multi_device:
            raise RequestError(
                "embeddings are pooled on a single device only; this engine is tensor or pipeline parallel: serve "
                "the model on one device for embeddings",
                request_id,
                "embed",
            )
        total = len(ids) + (0 if params.embed else params.max_tokens)  # an embedding computes its prompt alone
        if self.recipe is not None:
            self.recipe.guards.check_request(request_id, seq_len=total, first=len(ids), span=self.max_model_len)
            self.shaper.check_admission(request_id, len(ids), self.chunked_prefill)
        if total > self.max_model_len and params.embed:
            raise RequestError(
                f"the input ({len(ids)} tokens) exceeds max_model_len={self.max_model_len}; shorten it",
                request_id,
                "prompt",
            )
        if total > self.max_model_len:  # a generation: its prompt and the room for its output
            raise RequestError(
                f"prompt ({len(ids)} token{'s' if len(ids) != 1 else ''}) + max_tokens ({params.max_tokens}) = "
                f"{total} tokens exceeds max_model_len={self.max_model_len}; shorten the prompt or lower max_tokens",
                request_id,
                "max_tokens",
            )
        if short := self.blocks_short(total):
            raise RequestError(
                f"{total} tokens need {short[0]} KV blocks at once but the cache holds "
                f"{short[1]}; lower max_tokens or enlarge the KV cache",
                request_id,
                "max_tokens",
            )
        # NOTE: an unseeded request draws its seed from the engine's generator: fresh OS entropy unless the
        # engine was given --seed (then a run of the same requests repeats).
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._seed_rng))
        generator = None if params.is_greedy else torch.Generator().manual_seed(seed)
        request = Request(request_id, text, ids, params, generator=generator, options=options)
        if (constraint := params.structured_output) is not None:
            if self.grammars is None:
                raise RequestError("structured outputs need the model's tokenizer", request_id, constraint.param)
            request.grammar = self.grammars.start(constraint)  # compiled already when the server prepared it
        return request

    def _prompt_ids(self, request_id: str, prompt: str | list[int]) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer: give the prompt as token ids", request_id, "prompt")
            ids, text = self.tokenizer.encode(prompt), prompt
        else:
            ids, text = list(prompt), None
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(
                    f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", request_id, "prompt"
                )
        if not ids:
            raise RequestError("the prompt is empty: expected at least one token", request_id, "prompt")
        return ids, text
