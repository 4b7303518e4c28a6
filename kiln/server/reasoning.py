"""Reasoning read out of a chat answer: the `<think>...</think>` a reasoning model writes before its answer goes to
`reasoning_content`, the rest to `content` (as vLLM's `--reasoning-parser`, one registry entry per model family).

- `qwen3`: the model opens its thinking itself: an output that starts (after blanks) with `<think>` reasons until
  `</think>`; one that does not is all answer (as with `enable_thinking: false`, where the template wrote an empty
  `<think></think>` into the prompt).
- `deepseek_r1`: the template may already have opened the thinking, so the output starts inside it (a leading
  `<think>` is dropped): everything before `</think>` is reasoning, and an output without one is all reasoning.

`split_reasoning` reads an output's text so far; what it returns only grows as the text grows (a tag cut across
two deltas is held back until it is whole or the output ends), so the streamed deltas join to the final split.
Tool calls are read from the content alone (kiln.server.formats). A structured output is held to its grammar after
the reasoning (`reasoning_gate`), so the answer, not the thinking, matches the schema.
"""

from __future__ import annotations

from dataclasses import dataclass

import jinja2

from kiln.engine.structured.reasoning_gate import ReasoningGate
from kiln.errors import RequestError
from kiln.model.tokenizer import KilnTokenizer


@dataclass(frozen=True)
class ReasoningParser:
    """A way of writing reasoning. `starts_inside`: the output may begin inside the reasoning, with no opening
    tag (the chat template wrote it into the prompt)."""

    name: str
    starts_inside: bool
    start: str = "<think>"
    end: str = "</think>"


REASONING_PARSERS: dict[str, ReasoningParser] = {
    p.name: p
    for p in (
        ReasoningParser("qwen3", starts_inside=False),
        ReasoningParser("deepseek_r1", starts_inside=True),
    )
}


@dataclass(frozen=True)
class ReasoningSplit:
    """An output's text so far, split: `reasoning` (None: the output has none), `content` (the answer)."""

    reasoning: str | None
    content: str


def split_reasoning(parser: ReasoningParser, text: str, final: bool) -> ReasoningSplit:
    """`text` (an output so far) split into reasoning and answer. Unless `final`, text that may still become a tag
    (blanks or `<thi` at the start, `</thi` at the end of the reasoning) is held back from both."""
    body = text.lstrip()
    if body.startswith(parser.start):
        inner = len(text) - len(body) + len(parser.start)
    elif not final and parser.start.startswith(body):  # blanks, or the start of an opening tag: undecided
        return ReasoningSplit(None, "")
    elif parser.starts_inside:
        inner = 0
    else:
        return ReasoningSplit(None, text)
    end = text.find(parser.end, inner)
    if end >= 0:
        return ReasoningSplit(text[inner:end], text[end + len(parser.end) :])
    reasoning = text[inner:]
    if not final:
        reasoning = reasoning[: len(reasoning) - _partial_tag_len(reasoning, parser.end)]
    return ReasoningSplit(reasoning, "")


def reasoning_gate(parser: ReasoningParser, tokenizer: KilnTokenizer) -> ReasoningGate:
    """Where a constrained output's grammar starts (kiln.engine.structured.structured_output.ReasoningGate): after
    the reasoning's closing tag, as vLLM holds a reasoning model's structured output; the output starts inside the
    reasoning when the parser's outputs do (and the prompt left it open), else its opening tag, when one token, may
    open one as its first token."""
    start = tokenizer.encode(parser.start, add_special_tokens=False)
    end = tokenizer.encode(parser.end, add_special_tokens=False)
    return ReasoningGate(tuple(end), start[0] if len(start) == 1 else None, inside=parser.starts_inside)


def _partial_tag_len(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `tag` (0: none)."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:n])), 0)


class ReasoningReader:
    """One choice's output read as it streams: `read(text_so_far)` gives the reasoning and the content that are new
    since the last read; `split` is the whole split so far (the content is what a tool-call reader reads)."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.split = ReasoningSplit(None, "")
        self._num_reasoning_sent = 0
        self._num_content_sent = 0

    def read(self, text: str, final: bool) -> tuple[str, str]:
        """The new reasoning text and the new content text in `text`, the output so far (`final`: all of it)."""
        self.split = split_reasoning(self.parser, text, final)
        reasoning = self.split.reasoning or ""
        new_reasoning, new_content = reasoning[self._num_reasoning_sent :], self.split.content[self._num_content_sent :]
        self._num_reasoning_sent, self._num_content_sent = len(reasoning), len(self.split.content)
        return new_reasoning, new_content


def choose_reasoning_parser(tokenizer: KilnTokenizer, override: str | None) -> tuple[str | None, str]:
    """The reasoning parser for a model (None: answers are not split) and why; `override` (--reasoning-parser)
    wins, `none` turning it off. Otherwise the chat template decides: one that writes `<think>` into the
    generation prompt gets `deepseek_r1` (its outputs start inside the thinking), one that mentions `<think>`
    otherwise gets `qwen3`."""
    if override is not None:
        if override != "none" and override not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {override!r}: expected one of {sorted(REASONING_PARSERS)}")
        return (None if override == "none" else override), "--reasoning-parser"
    template = tokenizer.chat_template or ""
    if "<think>" not in template:
        return None, "the chat template writes no <think>; --reasoning-parser chooses one"
    if _generation_prompt_opens_thinking(tokenizer):
        return "deepseek_r1", "the chat template's generation prompt opens <think>"
    return "qwen3", "the chat template writes <think>"


def _generation_prompt_opens_thinking(tokenizer: KilnTokenizer) -> bool:
    """The template's prompt for an answer ends with `<think>` (rendered for one user message)."""
    try:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    except (jinja2.TemplateError, RequestError, TypeError, ValueError):  # it wants another conversation: no sign
        return False
    return prompt.rstrip().endswith("<think>")
