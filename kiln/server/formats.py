"""The two OpenAI response shapes over one serving loop: `text_completion` and `chat.completion`.

A format is made per HTTP request; it builds the streamed choice for each RequestOutput, the final choice of a
finished one, and the envelope (id, created, model) around both.

Prompt logprobs (vLLM's `prompt_logprobs`) go in each completion choice, and at the top of a chat response (vLLM's
places); streamed, in each choice's first chunk. `/v1/completions`' `echo` puts the prompt before the output in the
text and, with `logprobs`, its tokens' logprobs before the output's (the first token's null), streamed in the first
chunk; with `max_tokens: 0` the output is not shown (`CompletionFormat.shown`).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from kiln.engine.request import RequestOutput
from kiln.server.reasoning import ReasoningParser, ReasoningReader, split_reasoning
from kiln.server.responses import LogprobFormatter
from kiln.server.tool_fields import ToolUse
from kiln.server.tool_parsers import ToolParser
from kiln.server.tool_reader import ToolCallReader

PROMPT_TAIL_TOKENS = 16  # a prompt's last tokens, where a template writes its closing </think>


class ResponseFormat(ABC):
    object_name: str
    chunk_object_name: str
    reasoning: ReasoningParser | None = None  # how answers split into reasoning and content (chat only)

    def __init__(
        self,
        response_id: str,
        model: str,
        logprobs: LogprobFormatter,
        num_logprobs: int | None,
        with_prompt_logprobs: bool = False,
    ) -> None:
        """`with_prompt_logprobs`: the request sent vLLM's prompt_logprobs, so its answer carries them."""
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())
        self.logprobs = logprobs
        self.num_logprobs = num_logprobs
        self.with_prompt_logprobs = with_prompt_logprobs
        self._prompt_sent: set[int] = set()  # streamed choices whose prompt logprobs went out

    def shown(self, out: RequestOutput) -> RequestOutput:
        """The output as the answer shows it (and its usage counts it)."""
        return out

    def prompt_logprobs(self, out: RequestOutput) -> list[Any] | None:
        """vLLM's `prompt_logprobs` of the output, when the request asked for them."""
        if not self.with_prompt_logprobs or out.prompt_logprobs is None:
            return None
        return self.logprobs.vllm_prompt(out.prompt_logprobs)

    def first_chunk_extras(self, index: int, out: RequestOutput) -> dict[str, Any]:
        """What a streamed choice's first chunk carries beside the output: its prompt logprobs, once."""
        if index in self._prompt_sent or (lps := self.prompt_logprobs(out)) is None:
            return {}
        self._prompt_sent.add(index)
        return {"prompt_logprobs": lps}

    def envelope(self, obj: str, choices: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.response_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage
        return body

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.envelope(self.chunk_object_name, choices, usage)

    def response(self, choices: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
        return self.envelope(self.object_name, choices, usage)

    def opening_choices(self, indices: list[int]) -> list[dict[str, Any]]:
        """Choices streamed before any token (chat announces the assistant role)."""
        return []

    def see_prompt(self, prompt_ids: list[int], decode: Callable[[list[int]], str]) -> None:
        """Learn what the answers follow, before any is read (a chat prompt may have closed the thinking); the
        completion format reads its answers alike after any prompt."""
        return None

    @abstractmethod
    def stream_choice(
        self, index: int, out: RequestOutput, new_ids: list[int], new_logprobs: list[dict[int, float]] | None
    ) -> dict[str, Any] | None:
        """The streamed choice for this step's output, or None when there is nothing to send yet."""

    @abstractmethod
    def final_choice(self, index: int, out: RequestOutput) -> dict[str, Any]:
        """The choice of a non-streaming response for a finished output."""


@dataclass(frozen=True)
class Echo:
    """/v1/completions' `echo`: the request's prompts (text, or token ids decoded), each choice `i` showing prompt
    `i // n`; `output_hidden`: `max_tokens: 0`, the prompt alone."""

    prompts: list[str | list[int]]
    n: int
    output_hidden: bool = False


class CompletionFormat(ResponseFormat):
    object_name = chunk_object_name = "text_completion"

    def __init__(
        self,
        response_id: str,
        model: str,
        logprobs: LogprobFormatter,
        num_logprobs: int | None,
        with_prompt_logprobs: bool = False,
        echo: Echo | None = None,
    ) -> None:
        super().__init__(response_id, model, logprobs, num_logprobs, with_prompt_logprobs)
        self.echo = echo
        self._text_offsets: dict[int, int] = {}
        self._echoed: set[int] = set()

    def shown(self, out: RequestOutput) -> RequestOutput:
        if self.echo is None or not self.echo.output_hidden:
            return out
        empty = [] if out.logprobs is not None else None
        finish = "length" if out.finish_reason in ("stop", "length") else out.finish_reason
        return replace(out, text="", delta="", token_ids=[], logprobs=empty, finish_reason=finish, stop_reason=None)

    def stream_choice(
        self, index: int, out: RequestOutput, new_ids: list[int], new_logprobs: list[dict[int, float]] | None
    ) -> dict[str, Any] | None:
        first = self.echo is not None and index not in self._echoed
        if not (first or out.delta or out.finished or new_logprobs):
            return None
        text, lp = out.delta, None
        if first:
            self._echoed.add(index)
            prompt_text, lp = self._echoed_prompt(index, out)
            text = prompt_text + text
            self._text_offsets[index] = len(prompt_text)
        if new_logprobs is not None:
            new = self.logprobs.completion(new_ids, new_logprobs, self._text_offsets.get(index, 0))
            if new["text_offset"]:
                self._text_offsets[index] = new["text_offset"][-1] + len(new["tokens"][-1])
            lp = _joined(lp, new)
        finish = out.finish_reason if out.finished else None
        choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
        return {**choice, **self.first_chunk_extras(index, out)}

    def final_choice(self, index: int, out: RequestOutput) -> dict[str, Any]:
        text, lp, offset = out.text, None, 0
        if self.echo is not None:
            prompt_text, lp = self._echoed_prompt(index, out)
            text, offset = prompt_text + text, len(prompt_text)
        if out.logprobs is not None:
            lp = _joined(lp, self.logprobs.completion(out.token_ids, out.logprobs, offset))
        choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": out.finish_reason}
        if (prompt_lps := self.prompt_logprobs(out)) is not None:
            choice["prompt_logprobs"] = prompt_lps
        return choice

    def _echoed_prompt(self, index: int, out: RequestOutput) -> tuple[str, dict[str, list[Any]] | None]:
        """Choice `index`'s prompt as echoed: its text, and its tokens' logprobs when the request asks for
        logprobs."""
        assert self.echo is not None
        prompt = self.echo.prompts[index // self.echo.n]
        text = prompt if isinstance(prompt, str) else self.logprobs.tokenizer.decode(prompt, skip_special_tokens=False)
        if self.num_logprobs is None:
            return text, None
        return text, self.logprobs.echoed_prompt(out.prompt_token_ids, out.prompt_logprobs)


def _joined(first: dict[str, list[Any]] | None, then: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """Two /v1/completions logprobs objects as one (the echoed prompt's, then the output's)."""
    if first is None:
        return then
    return {key: first[key] + then[key] for key in first}


class ChatFormat(ResponseFormat):
    """`chat.completion`; with a reasoning parser, each choice's reasoning goes to `reasoning_content` (in the
    message and in the streamed deltas) and the rest is its answer; with tools, the answer is read for calls
    (`tool_calls` in the message and in the streamed deltas, finish_reason "tool_calls"). Without parallel calls,
    only the first call is kept."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(
        self,
        response_id: str,
        model: str,
        logprobs: LogprobFormatter,
        num_logprobs: int | None,
        tools: ToolUse | None = None,
        parser: ToolParser | None = None,
        reasoning: ReasoningParser | None = None,
        with_prompt_logprobs: bool = False,
    ) -> None:
        super().__init__(response_id, model, logprobs, num_logprobs, with_prompt_logprobs)
        self.tools, self.parser, self.reasoning = tools, parser, reasoning
        self._readers: dict[int, ToolCallReader | None] = {}
        self._reasoning_readers: dict[int, ReasoningReader] = {}
        self._prompt_logprobs: list[Any] | None = None  # the prompt's (every choice has the same prompt)

    def see_prompt(self, prompt_ids: list[int], decode: Callable[[list[int]], str]) -> None:
        """A prompt that ends with `</think>` (a template's empty thinking, `enable_thinking: false`) leaves no
        thinking open, so even a parser whose outputs start inside it reads this one as answer unless it opens
        `<think>` itself."""
        if self.reasoning is not None and self.reasoning.starts_inside:
            tail = decode(prompt_ids[-PROMPT_TAIL_TOKENS:])
            if tail.rstrip().endswith(self.reasoning.end):
                self.reasoning = replace(self.reasoning, starts_inside=False)

    def response(self, choices: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
        body = super().response(choices, usage)
        if self._prompt_logprobs is not None:
            body["prompt_logprobs"] = self._prompt_logprobs
        return body

    def opening_choices(self, indices: list[int]) -> list[dict[str, Any]]:
        delta = {"role": "assistant", "content": ""}
        return [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None} for i in indices]

    def stream_choice(
        self, index: int, out: RequestOutput, new_ids: list[int], new_logprobs: list[dict[int, float]] | None
    ) -> dict[str, Any] | None:
        lp = None
        if new_logprobs is not None and self.num_logprobs is not None:
            lp = {"content": self.logprobs.chat(new_ids, new_logprobs, self.num_logprobs)}
        reader = self._reader(index)
        delta: dict[str, Any] = {"content": out.delta} if out.delta else {}
        content = out.text
        if self.reasoning is not None:
            thinking = self._reasoning_readers.setdefault(index, ReasoningReader(self.reasoning))
            new_reasoning, new_content = thinking.read(out.text, out.finished)
            content = thinking.split.content
            delta = {"content": new_content} if new_content else {}
            if new_reasoning:
                delta["reasoning_content"] = new_reasoning
        if reader is not None:  # the calls are read from the answer, after the reasoning
            reading = reader.read(content, out.finished)
            delta = {k: v for k, v in delta.items() if k == "reasoning_content"}
            if reading.content:
                delta["content"] = reading.content
            calls = [c for c in reading.tool_calls if self._kept(c["index"])]
            if calls:
                delta["tool_calls"] = calls
        if not (delta or out.finished or lp):
            return None
        finish = self._finish_reason(reader, out) if out.finished else None
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return {**choice, **self.first_chunk_extras(index, out)}

    def final_choice(self, index: int, out: RequestOutput) -> dict[str, Any]:
        if self._prompt_logprobs is None:
            self._prompt_logprobs = self.prompt_logprobs(out)
        lp = None
        if out.logprobs is not None and self.num_logprobs is not None:
            lp = {"content": self.logprobs.chat(out.token_ids, out.logprobs, self.num_logprobs)}
        message: dict[str, Any] = {"role": "assistant", "content": out.text}
        if self.reasoning is not None:  # as vLLM: null for a part the output does not have
            split = split_reasoning(self.reasoning, out.text, final=True)
            message = {"role": "assistant", "content": split.content or None, "reasoning_content": split.reasoning}
        reader = self._reader(index)
        if reader is not None:
            reader.read(message["content"] or "", final=True)
            calls = reader.calls if reader.named is not None else reader.whole_calls
            if not calls:
                reader = None  # no whole call: the text is the answer, as written
            else:  # as streamed: the content before the calls, and the calls (a call cut off is left out)
                kept = [c.message() for c in calls if self._kept(c.index)]
                message |= {"content": reader.content if reader.content.strip() else None, "tool_calls": kept}
        return {"index": index, "message": message, "logprobs": lp, "finish_reason": self._finish_reason(reader, out)}

    def _reader(self, index: int) -> ToolCallReader | None:
        if index not in self._readers:
            use, parser = self.tools, self.parser
            self._readers[index] = use.reader(parser) if use is not None and parser is not None else None
        return self._readers[index]

    def _kept(self, call_index: int) -> bool:
        return self.tools is None or self.tools.parallel or call_index == 0

    def _finish_reason(self, reader: ToolCallReader | None, out: RequestOutput) -> str | None:
        if reader is not None and self.tools is not None and reader.has_calls and out.finish_reason == "stop":
            return self.tools.finish_reason
        return out.finish_reason
