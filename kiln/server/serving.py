"""/v1/completions and /v1/chat/completions: validate, tokenize off the event loop, add to the engine, answer.

Each HTTP request becomes one engine request per (prompt, choice); all are added at once, so a rejected one
adds none. The request's size (prompt characters, prompts x n, stop strings) is checked against the server's
limits, and room in the engine's queue is held for it, before anything is tokenized. Streaming answers are SSE
ending in `data: [DONE]`, also when they fail (an error event comes first); a client that disconnects
(streaming or not) has its requests aborted, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, TypeVar

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kiln.engine.request import RequestOutput
from kiln.engine.sampling.sampling_params import SamplingParams
from kiln.engine.serving.async_engine import AsyncEngine
from kiln.engine.serving.request_stream import RequestStream
from kiln.errors import RequestError
from kiln.lora.request import LoRARequest
from kiln.server.adapters import adapter_cards
from kiln.server.answers import EngineStreamingResponse, raise_if_failed, unless_disconnected
from kiln.server.errors import CLIENT_CLOSED, APIError, error_body, expected_error, internal_error
from kiln.server.formats import ChatFormat, CompletionFormat, Echo, ResponseFormat
from kiln.server.grammar_compiler import GrammarCompiler
from kiln.server.grammar_limits import GRAMMAR_COMPILE_THREADS, GrammarLimits
from kiln.server.limits import MESSAGE_MARKUP_CHARS, ServerLimits
from kiln.server.metrics import ServerMetrics
from kiln.server.middleware import request_id_of
from kiln.server.protocol import ChatCompletionRequest, ChatPrompt, CompletionRequest, SamplingFields, prompt_param
from kiln.server.reasoning import REASONING_PARSERS, choose_reasoning_parser, reasoning_gate
from kiln.server.responses import SSE_DONE, LogprobFormatter, Usage, sse
from kiln.server.tool_parsers import TOOL_PARSERS, choose_tool_parser
from kiln.server.tool_prompt import prompt_messages, refuse_control_text

logger = logging.getLogger("kiln")

T = TypeVar("T")


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncEngine,
        metrics: ServerMetrics,
        limits: ServerLimits,
        served_model_name: str,
        aliases: Sequence[str] = (),
        parse_special_tokens: bool = True,
        tool_call_parser: str | None = None,
        grammar_limits: GrammarLimits | None = None,
        grammar_compile_threads: int = GRAMMAR_COMPILE_THREADS,
        reasoning_parser: str | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.limits = limits
        self.served_model_name = served_model_name
        self.model_names = {served_model_name, *aliases}
        self.tokenizer = engine.core.tokenizer
        # a text prompt's `<|im_start|>`... are control tokens (vLLM's behaviour), or text (--completion-special-tokens)
        self.encode_text = self.tokenizer.encode if parse_special_tokens else self.tokenizer.encode_as_text
        self.max_model_len = engine.core.max_model_len
        self.logprobs = LogprobFormatter(self.tokenizer)
        self.max_num_seqs = engine.core.config.scheduler.max_num_seqs
        # NOTE: one thread, not asyncio's pool: the tokenizer holds the GIL for a whole encode (~1 s per million
        # characters), so the event loop waits for at most one encode at a time instead of one per pool thread;
        # encodes cannot run in parallel under the GIL anyway.
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="kiln-tokenize")
        self.grammar_compiler = GrammarCompiler(
            engine.core.grammars, grammar_limits or GrammarLimits(), grammar_compile_threads
        )
        tok = self.tokenizer
        name, why = choose_tool_parser(tok.chat_template, tok.template_knows_tools, tool_call_parser)
        logger.info("Tool calls: %s parser (%s)", name, why)
        self.tool_parser = TOOL_PARSERS[name]
        opener = self.tool_parser.opener
        self._tool_opener_is_special = opener in tok.special_token_texts
        reasoning, why = choose_reasoning_parser(tok, reasoning_parser)
        logger.info("Reasoning: %s parser (%s)", reasoning or "no", why)
        self.reasoning_parser = REASONING_PARSERS[reasoning] if reasoning is not None else None
        # NOTE: a model whose <think> tags are special tokens would have them skipped from the text the parser reads
        is_tag_special = self.reasoning_parser is not None and self.reasoning_parser.end in tok.special_token_texts
        self._reasoning_tags_are_special = is_tag_special

    def close(self) -> None:
        """Let the tokenizer and grammar threads exit once its queued work is done (the app's shutdown calls this)."""
        self._tokenizer_thread.shutdown(wait=False)
        self.grammar_compiler.close()

    # -- endpoints --------------------------------------------------------------------------------
    async def completions(self, request: Request, body: CompletionRequest) -> Response:
        arrival = time.monotonic()
        lora = self.check_model(body.model)
        body.check_supported()
        body.check_stream_options()
        self.limits.check_stop(body.stop_strings())
        prompts = body.prompts()
        self.limits.check_num_seqs(len(prompts), body.n)
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                self.limits.check_prompt_chars(len(prompt), prompt_param(body.prompt, i))
        echo = Echo(prompts, body.n, body.echo_only) if body.echo else None
        rid = f"cmpl-{uuid.uuid4().hex}"
        fmt = CompletionFormat(
            rid,
            lora.lora_name if lora is not None else self.served_model_name,
            self.logprobs,
            body.logprobs,
            with_prompt_logprobs=body.prompt_logprobs is not None,
            echo=echo,
        )
        tokenize = functools.partial(self._tokenize, prompts)
        max_tokens = body.engine_max_tokens
        return await self._serve(
            request=request,
            body=body,
            fmt=fmt,
            tokenize=tokenize,
            num_prompts=len(prompts),
            max_tokens=max_tokens,
            num_logprobs=body.logprobs,
            arrival=arrival,
            lora=lora,
        )

    async def chat(self, request: Request, body: ChatCompletionRequest) -> Response:
        arrival = time.monotonic()
        lora = self.check_model(body.model)
        body.check_stream_options()
        self.limits.check_stop(body.stop_strings())
        self.limits.check_num_seqs(1, body.n)
        tokenize = self.chat_prompt(body)
        tools = body.tool_use
        num_logprobs = body.num_logprobs
        fmt = ChatFormat(
            f"chatcmpl-{uuid.uuid4().hex}",
            lora.lora_name if lora is not None else self.served_model_name,
            self.logprobs,
            num_logprobs,
            tools=tools,
            parser=self.tool_parser,
            reasoning=self.reasoning_parser,
            with_prompt_logprobs=body.prompt_logprobs is not None,
        )
        keep_special = self._reasoning_tags_are_special or (
            tools is not None and tools.mode == "auto" and self._tool_opener_is_special
        )
        return await self._serve(
            request=request,
            body=body,
            fmt=fmt,
            tokenize=tokenize,
            num_prompts=1,
            max_tokens=body.requested_max_tokens,
            num_logprobs=num_logprobs,
            arrival=arrival,
            keep_special_tokens=keep_special,
            lora=lora,
        )

    def chat_prompt(self, body: ChatPrompt, add_generation_prompt: bool = True) -> Callable[[], list[list[int]]]:
        """The work that tokenizes a chat's prompt (run it on the tokenizer thread: `in_tokenizer_thread`), once
        the request's messages, tools and template variables are checked, within the prompt limit."""
        tools = body.tool_use
        template_kwargs = body.template_kwargs(self.tokenizer.template_variables)
        messages, shown = prompt_messages(
            body.template_messages(), tools.shown if tools else (), self.tokenizer.template_knows_tools
        )
        # NOTE: the messages become one prompt, so their texts share one limit, and each message costs the
        # template's markup too (150k empty messages were 0 characters, yet rendering them stalled the server)
        chars = sum(MESSAGE_MARKUP_CHARS + _chars(m) for m in messages) + _chars(shown or [])
        self.limits.check_prompt_chars(chars + _chars(template_kwargs), "messages")
        return functools.partial(self._chat_prompt, messages, shown, template_kwargs, add_generation_prompt)

    def models(self) -> dict[str, Any]:
        card = {
            "id": self.served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "kiln",
            "max_model_len": self.max_model_len,
        }
        return {"object": "list", "data": [card, *adapter_cards(self.engine.core.lora, self.served_model_name)]}

    # -- shared -----------------------------------------------------------------------------------
    async def _serve(
        self,
        request: Request,
        body: SamplingFields,
        fmt: ResponseFormat,
        tokenize: Callable[[], list[list[int]]],
        num_prompts: int,
        max_tokens: int | None,
        num_logprobs: int | None,
        arrival: float,
        keep_special_tokens: bool = False,
        lora: LoRARequest | None = None,
    ) -> Response:
        # NOTE: the room is held while the tokenizer works, so a flood is answered 429 before it is tokenized
        constraint = body.structured_output()
        request_id = request_id_of(request)
        if constraint is not None:
            self.grammar_compiler.limits.check(constraint)  # before any work
        with self.engine.reserve(num_prompts * body.n) as reservation:
            prompt_ids = await self.in_tokenizer_thread(tokenize)
            fmt.see_prompt(prompt_ids[0], functools.partial(self.tokenizer.decode, skip_special_tokens=False))
            if constraint is not None and fmt.reasoning is not None:  # the grammar holds the answer, after thinking
                constraint = replace(constraint, after_reasoning=reasoning_gate(fmt.reasoning, self.tokenizer))
            if constraint is not None:  # compiled on its own pool, off the step loop; the engine finds it cached
                client = request.client.host if request.client else "unknown"
                await self.grammar_compiler.compile(constraint, client, request_id)
            jobs: list[tuple[str, list[int], SamplingParams]] = []
            for p, ids in enumerate(prompt_ids):
                # NOTE: no max_tokens means "the rest of the context"; with no room left, 1 token makes the engine
                # reject the request with both numbers and the limit in the message.
                limit = max_tokens if max_tokens is not None else max(self.max_model_len - len(ids), 1)
                for c in range(body.n):
                    params = body.sampling_params(
                        max_tokens=limit,
                        logprobs=num_logprobs,
                        choice_index=c,
                        constraint=constraint,
                        keep_special_tokens=keep_special_tokens,
                    )
                    jobs.append((f"{fmt.response_id}-{p * body.n + c}", ids, params))
            stream = await self.engine.add_requests(jobs, reservation, body.priority, lora)
        index = {rid: i for i, (rid, _, _) in enumerate(jobs)}
        firsts = frozenset(rid for rid, i in index.items() if i % body.n == 0)
        counts = Usage(sum(len(ids) for ids in prompt_ids), firsts)
        if body.stream:
            events = self._stream(
                stream=stream,
                fmt=fmt,
                index=index,
                counts=counts,
                include_usage=body.include_usage_in_stream,
                arrival=arrival,
                request_id=request_id,
            )
            return EngineStreamingResponse(events, on_close=lambda: self._close(stream))
        finals = await self.collect_finals(request, stream, arrival)
        if finals is None:
            logger.info("client went away; aborted %s", fmt.response_id)
            return Response(status_code=CLIENT_CLOSED)
        outputs = [fmt.shown(finals[rid]) for rid in index]
        for out in outputs:
            raise_if_failed(out, request_id)
            counts.add(out)
        choices = [fmt.final_choice(index[out.request_id], out) for out in outputs]
        body_json = fmt.response(choices, counts.to_dict())
        return JSONResponse(body_json)

    async def collect_finals(
        self, request: Request, stream: RequestStream, arrival: float
    ) -> dict[str, RequestOutput] | None:
        """The final outputs of `stream`'s requests, by id (None: the client went away first, and they are
        aborted); the stream is closed either way."""
        try:
            return await unless_disconnected(request, self._collect(stream, arrival))
        finally:
            self._close(stream)

    async def _collect(self, stream: RequestStream, arrival: float) -> dict[str, RequestOutput]:
        finals: dict[str, RequestOutput] = {}
        async for out in stream:
            if out.finished:
                finals[out.request_id] = out
                self.metrics.observe_finished(out, arrival)
        return finals

    def _close(self, stream: RequestStream) -> None:
        """Abort what the stream has not finished (a client that went away, a failed sibling choice) and count it."""
        num_unfinished = len(stream.unfinished)
        stream.close()
        if num_unfinished:
            self.metrics.finished.labels(finish_reason="abort").inc(num_unfinished)

    async def _stream(
        self,
        stream: RequestStream,
        fmt: ResponseFormat,
        index: dict[str, int],
        counts: Usage,
        include_usage: bool,
        arrival: float,
        request_id: str,
    ) -> AsyncIterator[str]:
        num_sent = dict.fromkeys(index, 0)
        opening = fmt.opening_choices(sorted(index.values()))
        try:
            if opening:
                yield sse(fmt.chunk(opening))
            async for engine_out in stream:
                out = fmt.shown(engine_out)
                if out.finished:
                    self.metrics.observe_finished(out, arrival)
                    counts.add(out)
                raise_if_failed(out, request_id)
                start, num_sent[out.request_id] = num_sent[out.request_id], len(out.token_ids)
                new_logprobs = out.logprobs[start:] if out.logprobs is not None else None
                choice = fmt.stream_choice(index[out.request_id], out, out.token_ids[start:], new_logprobs)
                if choice is not None:
                    yield sse(fmt.chunk([choice]))
            if include_usage:
                yield sse(fmt.chunk([], counts.to_dict()))
        except Exception as exc:
            # NOTE: the status line is already sent; the error travels as an SSE event (OpenAI clients raise it).
            error = expected_error(exc)
            if error is None:
                logger.exception("request %s: streaming %s failed", request_id, fmt.response_id)
                error = internal_error(request_id)
            yield sse(error_body(error.status, error.message, error.param, error.code))
        finally:
            self._close(stream)
        yield SSE_DONE

    async def in_tokenizer_thread(self, fn: Callable[[], T]) -> T:
        """`fn()` run on the one tokenizer thread (see `__init__`)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn)

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` (a request's field) names (None: the base model); APIError 404 unless it is
        None, a name of the base model or a loaded adapter's (kiln.server.adapters)."""
        if model is None or model in self.model_names:
            return None
        lora = self.engine.core.lora.by_name(model) if self.engine.core.lora is not None else None
        if lora is None:
            shown = repr(model) if len(model) <= 100 else f"{model[:100]!r}... ({len(model)} characters)"
            raise APIError(
                404,
                f"model {shown} is not served here; this server serves {self.served_model_name!r} (see GET /v1/models)",
                "model",
                "model_not_found",
            )
        return lora

    def _tokenize(self, prompts: list[str | list[int]]) -> list[list[int]]:
        return [self.encode_text(p) if isinstance(p, str) else list(p) for p in prompts]

    def _chat_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template_kwargs: dict[str, Any],
        add_generation_prompt: bool,
    ) -> list[list[int]]:
        refuse_control_text(messages, tools, self.tokenizer.special_token_texts, template_kwargs)
        try:  # contents' special-token text stays text
            ids = self.tokenizer.encode_chat(
                messages, add_generation_prompt=add_generation_prompt, tools=tools, template_kwargs=template_kwargs
            )
            return [ids]
        except (jinja2.TemplateError, TypeError, ValueError) as exc:  # a template's own checks, or its filters'
            raise RequestError(f"the model's chat template rejected the messages: {exc}", None, "messages") from None


def _chars(value: Any) -> int:
    """The characters of a message's texts (or the tools'), as the prompt limit counts them: structured values
    (tool calls, definitions) by their JSON."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_chars(v) for v in value.values())
    return len(json.dumps(value, ensure_ascii=False))
