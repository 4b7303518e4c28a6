"""`POST /v1/embeddings`: OpenAI's request and answer over the engine's embedding requests
(kiln.engine.running.pooling).

`input` is a string, a list of strings, a list of token ids, or a list of those; each item is one engine request
(prefill only, pooled as `--pooling` says, batched in the engine's steps beside any other request). The answer is
OpenAI's `{"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model", "usage"}`; with
`encoding_format: "base64"` each vector is its little-endian float32 bytes in base64, as OpenAI and vLLM send it.
`dimensions` is refused: a decoder model's hidden state is not trained to be cut short (Matryoshka), so kiln always
answers the full hidden size. Unknown fields, the API key, the size limits and the metrics are the other routes'.
"""

from __future__ import annotations

import base64
import functools
import struct
import time
import uuid
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kiln.engine.sampling.sampling_params import SamplingParams
from kiln.errors import RequestError
from kiln.server.answers import raise_if_failed
from kiln.server.errors import CLIENT_CLOSED
from kiln.server.middleware import request_id_of
from kiln.server.protocol import check_text
from kiln.server.request_fields import RequestPart
from kiln.server.serving import OpenAIServing


class EmbeddingRequest(RequestPart):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] | None = "float"  # null: float
    dimensions: int | None = None  # declared to be refused with its reason (`check_supported`)

    def check_supported(self) -> None:
        if self.dimensions is not None:
            raise RequestError(
                f"dimensions={self.dimensions} is not supported: kiln pools a decoder model's final hidden state, "
                "which cannot be truncated meaningfully; leave dimensions out for the model's full hidden size",
                None,
                "dimensions",
            )

    def inputs(self) -> list[str | list[int]]:
        """`input` as a list of items (one string, a list of strings, one token-id list, or a list of those), text
        checked to be valid Unicode; an empty list, string or token list is refused naming it."""
        items: list[str | list[int]]
        if isinstance(self.input, str):
            items = [self.input]
        elif self.input and all(isinstance(x, int) for x in self.input):
            items = [list(self.input)]  # type: ignore[arg-type]
        else:
            items = list(self.input)  # type: ignore[arg-type]
        if not items:
            raise RequestError("input is an empty list: expected a string, strings or token ids", None, "input")
        for i, item in enumerate(items):
            if not item:
                raise RequestError("the input is empty: expected at least one token", None, self.param(i))
            if isinstance(item, str):
                check_text(item, self.param(i))
        return items

    def param(self, index: int) -> str:
        """How errors name input `index`: `input` when the request sent one string or one token list, else
        `input.<index>`."""
        one = isinstance(self.input, str) or all(isinstance(x, int) for x in self.input)
        return "input" if one else f"input.{index}"


def encode_vector(vector: list[float], encoding_format: str | None) -> list[float] | str:
    """A vector as the answer carries it: floats, or base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


class EmbeddingEndpoint:
    """The route over a serving's engine, tokenizer thread and limits."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def embeddings(self, request: Request, body: EmbeddingRequest) -> Response:
        arrival = time.monotonic()
        serving = self.serving
        serving.check_model(body.model)
        body.check_supported()
        items = body.inputs()
        serving.limits.check_num_seqs(len(items), 1)
        for i, item in enumerate(items):
            if isinstance(item, str):
                serving.limits.check_prompt_chars(len(item), body.param(i))
        response_id = f"embd-{uuid.uuid4().hex}"
        with serving.engine.reserve(len(items)) as reservation:
            prompt_ids = await serving.in_tokenizer_thread(functools.partial(self._tokenize, items))
            for i, ids in enumerate(prompt_ids):
                self._check_ids(ids, body.param(i))
            jobs = [(f"{response_id}-{i}", ids, SamplingParams(embed=True)) for i, ids in enumerate(prompt_ids)]
            stream = await serving.engine.add_requests(jobs, reservation)
        finals = await serving.collect_finals(request, stream, arrival)
        if finals is None:
            return Response(status_code=CLIENT_CLOSED)
        data = []
        for i, (rid, _, _) in enumerate(jobs):
            out = finals[rid]
            raise_if_failed(out, request_id_of(request))
            assert out.embedding is not None, "a finished embedding request has its vector"
            vector = encode_vector(out.embedding, body.encoding_format)
            data.append({"object": "embedding", "index": i, "embedding": vector})
        num_tokens = sum(len(ids) for ids in prompt_ids)
        answer: dict[str, Any] = {
            "id": response_id,
            "object": "list",
            "created": int(time.time()),
            "model": serving.served_model_name,
            "data": data,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        }
        return JSONResponse(answer)

    def _tokenize(self, items: list[str | list[int]]) -> list[list[int]]:
        return [self.serving.encode_text(item) if isinstance(item, str) else list(item) for item in items]

    def _check_ids(self, ids: list[int], param: str) -> None:
        """RequestError naming `param` for an input longer than the context or a token id outside the vocabulary."""
        max_len = self.serving.max_model_len
        if len(ids) > max_len:
            raise RequestError(
                f"the input is {len(ids)} tokens, more than max_model_len={max_len}; shorten it", None, param
            )
        vocab_size = self.serving.engine.core.model_config.vocab_size
        for token_id in ids:
            if not 0 <= token_id < vocab_size:
                raise RequestError(
                    f"token id {token_id} is not in the vocabulary (ids 0 to {vocab_size - 1})", None, param
                )
        if not ids:
            raise RequestError("the input tokenizes to nothing: expected at least one token", None, param)
