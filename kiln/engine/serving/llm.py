"""The offline API: `LLM(model=...).generate(prompts, params)`, `.chat(messages, params)` and `.embed(prompts)`."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tqdm import tqdm

from kiln.config import EngineConfig
from kiln.engine.request import RequestOutput
from kiln.engine.sampling.sampling_params import SamplingParams
from kiln.engine.setup.args import EngineArgs
from kiln.engine.setup.build import build_engine
from kiln.engine.setup.resolve import resolve_engine_config
from kiln.errors import RequestError
from kiln.log import setup_logging
from kiln.lora.request import LoRARequest

Prompt = str | list[int]
Messages = list[dict[str, Any]]


class LLM:
    """Loads a model once; runs batches of prompts to completion with continuous batching.

    `LLM(model, **options)` takes the engine options `EngineArgs` defines (the same as the CLI flags:
    `LLM(graph_mode="piecewise", capture_sizes=[1, 2, 4])`, `LLM(graph_mode="eager")`), or a ready
    `config=EngineConfig`. Graph mode (full_and_piecewise) is the default, as for every entry point.

    A request that cannot be served (too long, invalid) comes back finished with `finish_reason="error"`
    and `.error` set; the other requests in the batch still run.

    With `tensor_parallel_size` (or `pipeline_parallel_size`) above 1 the other ranks start as spawned processes,
    which import the caller's main module again: guard the script's work with `if __name__ == "__main__":`, and
    `close()` the LLM (or use it in a `with` block) to stop them.
    """

    def __init__(self, model: str = "default", *, config: EngineConfig | None = None, **options: Any) -> None:
        setup_logging()
        if config is None:
            config = resolve_engine_config(EngineArgs.from_kwargs(model=model, **options))
        self.engine = build_engine(config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the other ranks of a multi-device engine (nothing to do on one device)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. A list of ints is one tokenized prompt. `priority`: one per prompt,
        under the priority scheduling policy (lower runs first; vLLM's). `lora_request`: the LoRA adapter every
        prompt runs with, or one per prompt (None: the base model); the engine needs `enable_lora=True`."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params_list = _broadcast(params, len(prompts))
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"{len(priorities)} priorities for {len(prompts)} prompts: give one per prompt")
        adapters = _per_prompt(lora_request, len(prompts))
        order: list[str] = []
        results: dict[str, RequestOutput] = {}
        for prompt, p, rank, lora in zip(prompts, params_list, priorities, adapters, strict=True):
            rid = str(next(self._ids))
            order.append(rid)
            try:
                self.engine.add_request(rid, prompt, p, priority=rank, lora=lora)
            except RequestError as exc:
                results[rid] = _error_output(rid, prompt, str(exc))
        bar = tqdm(total=len(order), desc="Generating", unit="req", disable=not use_tqdm)
        while self.engine.has_unfinished:
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [results[rid] for rid in order]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Run one prompt, yielding an output (with `.delta`, the new text) after every step that adds tokens."""
        rid = str(next(self._ids))
        self.engine.add_request(rid, prompt, params or SamplingParams())
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort(rid)

    def embed(self, prompts: Prompt | Sequence[Prompt], use_tqdm: bool = False) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding, in the order of `prompts` (vLLM's `LLM.embed`: `.outputs.embedding`), pooled as
        the engine's `pooling` option says (kiln.engine.running.pooling). A list of ints is one tokenized prompt. A
        prompt that cannot be served (too long, invalid) raises RequestError naming it; the batch runs in the engine's
        steps as any other."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        outputs = self.generate(prompts, SamplingParams(embed=True), use_tqdm=use_tqdm)
        embedded = []
        for i, out in enumerate(outputs):
            if out.embedding is None:
                raise RequestError(f"prompt {i} could not be embedded: {out.error}", out.request_id, "prompt")
            embedded.append(
                EmbeddingRequestOutput(out.request_id, out.prompt_token_ids, EmbeddingOutput(out.embedding))
            )
        return embedded

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One conversation (a list of {role, content}) or many; the model's chat template makes the prompt."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        conversations = [list(c) for c in conversations]  # type: ignore[arg-type]
        # NOTE: the ids keep special-token text in contents as text (encode_chat); outputs carry the prompt's text
        prompts: list[Prompt] = [self.tokenizer.encode_chat(c) for c in conversations]
        outputs = self.generate(prompts, params, use_tqdm=use_tqdm)
        texts = [self.tokenizer.apply_chat_template(c) for c in conversations]
        return [replace(out, prompt=text) for out, text in zip(outputs, texts, strict=True)]


@dataclass(frozen=True)
class EmbeddingOutput:
    embedding: list[float]  # the pooled final hidden state (L2-normalized unless the engine was told not to)


@dataclass(frozen=True)
class EmbeddingRequestOutput:
    """One prompt's embedding, shaped as vLLM's `EmbeddingRequestOutput` (`.outputs.embedding`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput


def _per_prompt(lora: LoRARequest | Sequence[LoRARequest | None] | None, n: int) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * n
    adapters = list(lora)
    if len(adapters) != n:
        raise ValueError(f"{len(adapters)} LoRA requests for {n} prompts: give one, or one per prompt")
    return adapters


def _broadcast(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [replace(params) for _ in range(n)]
    if len(params) != n:
        raise RequestError(f"got {len(params)} SamplingParams for {n} prompts: pass one, or one per prompt")
    return list(params)


def _error_output(request_id: str, prompt: Prompt, message: str) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=[] if isinstance(prompt, str) else list(prompt),
        text="",
        token_ids=[],
        finished=True,
        finish_reason="error",
        error=message,
    )
