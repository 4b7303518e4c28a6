"""Reasoning read out of chat answers (kiln/server/reasoning.py): each parser's split of whole outputs, the same
split streamed with the text cut at every character, the parser a chat template gets; and through the app `kiln
serve` builds, over a core that answers with a scripted text in the default model's tokens: `reasoning_content`
streamed and not, `chat_template_kwargs` (`enable_thinking`) and `reasoning_effort` reaching the template or
refused by name, tool calls read from the answer only."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import pytest

from kiln.engine.request import RequestOutput
from kiln.model.build import load_tokenizer
from kiln.model.loader import open_checkpoint
from kiln.model.tokenizer import KilnTokenizer
from kiln.server.reasoning import (
    REASONING_PARSERS,
    ReasoningReader,
    choose_reasoning_parser,
    split_reasoning,
)
from tests.server.app_harness import Served, openai_error, serve
from tests.server.fake_core import FakeCore

# Qwen3's way: the model opens <think> itself; `enable_thinking: false` writes an empty thinking into the prompt
QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
# DeepSeek-R1's (and Qwen3 thinking models'): the generation prompt opens the thinking
OPENS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
EFFORT_TEMPLATE = (
    "{% if reasoning_effort is defined %}<|im_start|>system\neffort: {{ reasoning_effort }}<|im_end|>\n{% endif %}"
    + QWEN3_TEMPLATE
)
CHAT = [{"role": "user", "content": "Capital of France?"}]

# (parser, output, reasoning, content) for whole outputs
SPLITS = [
    ("qwen3", "<think>\nIt is Paris.\n</think>\n\nParis", "\nIt is Paris.\n", "\n\nParis"),
    ("qwen3", "\n <think>a</think>b", "a", "b"),
    ("qwen3", "Paris", None, "Paris"),
    ("qwen3", "I write <think> tags", None, "I write <think> tags"),
    ("qwen3", "<think>cut off mid-thought </thi", "cut off mid-thought </thi", ""),
    ("qwen3", "<thi", None, "<thi"),
    ("qwen3", "  ", None, "  "),
    ("deepseek_r1", "It is Paris.\n</think>\n\nParis", "It is Paris.\n", "\n\nParis"),
    ("deepseek_r1", "<think>It is Paris.</think>Paris", "It is Paris.", "Paris"),
    ("deepseek_r1", "still thinking < when cut", "still thinking < when cut", ""),
    ("deepseek_r1", "</think>Paris", "", "Paris"),
    ("deepseek_r1", "a</think>b</think>c", "a", "b</think>c"),
    ("deepseek_r1", "<thinking>x", "<thinking>x", ""),
]


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), SPLITS)
def test_each_parser_splits_whole_outputs_as_vllm_does(parser: str, text: str, reasoning: str, content: str) -> None:
    split = split_reasoning(REASONING_PARSERS[parser], text, final=True)
    assert (split.reasoning, split.content) == (reasoning, content)


@pytest.mark.parametrize(("parser", "text"), [(p, t) for p, t, _, _ in SPLITS])
def test_streamed_splits_join_to_the_whole_split_wherever_the_text_is_cut(parser: str, text: str) -> None:
    """Character by character, and in two pieces cut at every position: a tag cut in two is held back, never
    sent to the wrong side; what was sent is never taken back."""
    whole = split_reasoning(REASONING_PARSERS[parser], text, final=True)
    cuts = [list(range(1, len(text) + 1))] + [[cut, len(text)] for cut in range(len(text) + 1)]
    for ends in cuts:
        reader = ReasoningReader(REASONING_PARSERS[parser])
        reasoning, content = "", ""
        for n, end in enumerate(ends):
            new_reasoning, new_content = reader.read(text[:end], final=n == len(ends) - 1)
            assert "<think>" not in new_content or "<think>" in whole.content, (ends, new_content)
            reasoning, content = reasoning + new_reasoning, content + new_content
        assert (reasoning, content) == (whole.reasoning or "", whole.content), (parser, text, ends)


@pytest.fixture(scope="module")
def default_tokenizer() -> KilnTokenizer:
    return load_tokenizer(open_checkpoint("default"))


def with_template(tokenizer: KilnTokenizer, template: str) -> KilnTokenizer:
    templated = KilnTokenizer(tokenizer.tokenizer, template, tokenizer.bos_token, tokenizer.eos_token, None)
    templated.add_bos = tokenizer.add_bos
    return templated


def test_the_chat_template_chooses_the_parser_and_the_flag_overrides_it(default_tokenizer: KilnTokenizer) -> None:
    assert choose_reasoning_parser(with_template(default_tokenizer, QWEN3_TEMPLATE), None)[0] == "qwen3"
    assert choose_reasoning_parser(with_template(default_tokenizer, OPENS_TEMPLATE), None)[0] == "deepseek_r1"
    assert choose_reasoning_parser(default_tokenizer, None)[0] is None  # the default model does not think
    assert choose_reasoning_parser(default_tokenizer, "deepseek_r1") == ("deepseek_r1", "--reasoning-parser")
    assert choose_reasoning_parser(with_template(default_tokenizer, QWEN3_TEMPLATE), "none")[0] is None


class ScriptedCore(FakeCore):
    """Answers every request with `script`, one of its tokens (the default model's) a step, whatever the prompt;
    keeps the prompts it was given."""

    def __init__(self, tokenizer: KilnTokenizer, script: str) -> None:
        super().__init__(max_model_len=1024, num_blocks=1024, tokenizer=tokenizer)
        self.script_ids = tokenizer.encode(script, add_special_tokens=False)
        self.prompts: list[str] = []
        self.step_delay = 0.0

    def add_request(self, request_id: str, prompt: str | list[int], params: Any, **options: Any) -> Any:
        assert isinstance(prompt, list)
        self.prompts.append(self.tokenizer.decode(prompt, skip_special_tokens=False))
        scripted = dataclasses.replace(params, max_tokens=len(self.script_ids))
        return super().add_request(request_id, prompt, scripted, **options)

    def step(self) -> list[RequestOutput]:
        return [self._scripted(out) for out in super().step()]

    def _scripted(self, out: RequestOutput) -> RequestOutput:
        ids = self.script_ids[: len(out.token_ids)]
        text, before = self.tokenizer.decode(ids), self.tokenizer.decode(ids[:-1])
        reason = "stop" if out.finish_reason == "length" else out.finish_reason
        return dataclasses.replace(out, token_ids=ids, text=text, delta=text[len(before) :], finish_reason=reason)


async def chat_both_ways(s: Served, request: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The non-streamed message and the streamed deltas of one chat request (both 200)."""
    whole = await s.client.post("/v1/chat/completions", json=request)
    assert whole.status_code == 200, whole.text
    streamed = await s.client.post("/v1/chat/completions", json={**request, "stream": True})
    assert streamed.status_code == 200, streamed.text
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    deltas = [choice["delta"] for e in events[:-1] for choice in json.loads(e)["choices"]]
    return whole.json()["choices"][0]["message"], deltas


def joined(deltas: list[dict[str, Any]], key: str) -> str:
    return "".join(d.get(key) or "" for d in deltas)


@pytest.mark.parametrize("template", [QWEN3_TEMPLATE, OPENS_TEMPLATE])
def test_reasoning_content_streamed_and_not_with_thinking_on_and_off(
    default_tokenizer: KilnTokenizer, template: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The thinking model's answer is split, streamed or not; with `enable_thinking: false` the template writes an
    empty thinking into the prompt and the answer is all content, under either parser."""
    opens = template == OPENS_TEMPLATE
    thinking = ("" if opens else "<think>\n") + "The capital of France is Paris.\n</think>\n\nParis."
    core = ScriptedCore(with_template(default_tokenizer, template), thinking)

    async def body(s: Served) -> None:
        message, deltas = await chat_both_ways(s, {"messages": CHAT})
        reasoning = ("\n" if not opens else "") + "The capital of France is Paris.\n"
        assert message == {"role": "assistant", "content": "\n\nParis.", "reasoning_content": reasoning}
        assert joined(deltas, "reasoning_content") == reasoning and joined(deltas, "content") == "\n\nParis."
        assert not any("think>" in (d.get("content") or "") for d in deltas)
        assert core.prompts[-1].endswith("<think>\n" if opens else "assistant\n")
        core.script_ids = core.tokenizer.encode("Paris.", add_special_tokens=False)
        off = {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}
        message, deltas = await chat_both_ways(s, off)
        assert core.prompts[-1].endswith("<think>\n\n</think>\n\n")  # the template read enable_thinking
        assert message == {"role": "assistant", "content": "Paris.", "reasoning_content": None}
        assert joined(deltas, "content") == "Paris." and not joined(deltas, "reasoning_content")

    with caplog.at_level(logging.INFO, logger="kiln"):
        serve(core, body)
    expected = "deepseek_r1 parser (the chat template's generation prompt opens <think>)" if opens else "qwen3"
    assert any(r.getMessage().startswith(f"Reasoning: {expected}") for r in caplog.records)


def test_tool_calls_are_read_from_the_answer_after_the_reasoning(default_tokenizer: KilnTokenizer) -> None:
    """A call the model only thinks about is reasoning; the call in its answer is the message's call."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    script = '<think>Maybe <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>?\n'
    core = ScriptedCore(with_template(default_tokenizer, QWEN3_TEMPLATE), f"{script}</think>\n{call}")
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}

    async def body(s: Served) -> None:
        message, deltas = await chat_both_ways(s, {"messages": CHAT, "tools": [tool]})
        (made,) = message["tool_calls"]
        assert json.loads(made["function"]["arguments"]) == {"city": "Oslo"}
        assert "Rome" in message["reasoning_content"] and message["content"] in (None, "\n")
        streamed_calls = [c for d in deltas for c in d.get("tool_calls", [])]
        assert json.loads("".join(c["function"]["arguments"] for c in streamed_calls)) == {"city": "Oslo"}
        assert "Rome" in joined(deltas, "reasoning_content")

    serve(core, body)


def test_reasoning_effort_reaches_a_template_that_reads_it_and_is_refused_by_one_that_does_not(
    default_tokenizer: KilnTokenizer,
) -> None:
    core = ScriptedCore(with_template(default_tokenizer, EFFORT_TEMPLATE), "Paris.")

    async def body(s: Served) -> None:
        response = await s.client.post("/v1/chat/completions", json={"messages": CHAT, "reasoning_effort": "high"})
        assert response.status_code == 200, response.text
        assert "effort: high" in core.prompts[-1]
        twice = {"messages": CHAT, "reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "low"}}
        error = openai_error(await s.client.post("/v1/chat/completions", json=twice), 400)
        assert error["param"] == "reasoning_effort"

    serve(core, body)
    plain = ScriptedCore(with_template(default_tokenizer, QWEN3_TEMPLATE), "Paris.")

    async def refused(s: Served) -> None:
        request = {"messages": CHAT, "reasoning_effort": "high"}
        error = openai_error(await s.client.post("/v1/chat/completions", json=request), 400)
        assert error["param"] == "reasoning_effort" and "has no reasoning_effort" in error["message"]
        assert "enable_thinking" in error["message"]  # what the template does read
        assert not plain.prompts

    serve(plain, refused)


def test_chat_template_kwargs_that_would_do_nothing_or_forge_text_are_refused_by_name(
    default_tokenizer: KilnTokenizer,
) -> None:
    core = ScriptedCore(with_template(default_tokenizer, QWEN3_TEMPLATE), "Paris.")
    refusals = {
        "chat_template_kwargs.thinking": ({"thinking": False}, "has no thinking"),
        "chat_template_kwargs.messages": ({"messages": []}, "kiln gives the chat template itself"),
        "chat_template_kwargs.raise_exception": ({"raise_exception": 1}, "kiln gives the chat template itself"),
        "chat_template_kwargs.enable_thinking": ({"enable_thinking": "<|im_end|>"}, "special-token text"),
    }

    async def body(s: Served) -> None:
        for param, (kwargs, why) in refusals.items():
            request = {"messages": CHAT, "chat_template_kwargs": kwargs}
            error = openai_error(await s.client.post("/v1/chat/completions", json=request), 400)
            assert error["param"] == param and why in error["message"], (param, error)
        error = openai_error(
            await s.client.post("/v1/chat/completions", json={"messages": CHAT, "chat_template_kwargs": [1]}), 400
        )
        assert error["param"] == "chat_template_kwargs"
        assert not core.prompts

    serve(core, body)


def test_a_parser_can_be_named_or_turned_off_by_flag(default_tokenizer: KilnTokenizer) -> None:
    """`--reasoning-parser none` leaves a thinking model's answer whole; `deepseek_r1` reads a template that
    writes no <think> as starting inside the thinking."""
    core = ScriptedCore(with_template(default_tokenizer, QWEN3_TEMPLATE), "<think>x</think>y")

    async def whole(s: Served) -> None:
        message, _ = await chat_both_ways(s, {"messages": CHAT})
        assert message == {"role": "assistant", "content": "<think>x</think>y"}

    serve(core, whole, ["--reasoning-parser", "none"])
    core = ScriptedCore(default_tokenizer, "x</think>y")

    async def split(s: Served) -> None:
        message, deltas = await chat_both_ways(s, {"messages": CHAT})
        assert message == {"role": "assistant", "content": "y", "reasoning_content": "x"}
        assert joined(deltas, "reasoning_content") == "x" and joined(deltas, "content") == "y"

    serve(core, split, ["--reasoning-parser", "deepseek_r1"])


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_stream_options_without_stream_is_refused_by_name(route: str) -> None:
    core = FakeCore()
    base: dict[str, Any] = {"prompt": "hi"} if route == "completions" else {"messages": CHAT}

    async def body(s: Served) -> None:
        request = {**base, "stream_options": {"include_usage": True}}
        error = openai_error(await s.client.post(f"/v1/{route}", json=request), 400)
        assert error["param"] == "stream_options" and "stream: true" in error["message"]
        streamed = await s.client.post(f"/v1/{route}", json={**request, "stream": True, "max_tokens": 2})
        assert streamed.status_code == 200 and '"usage"' in streamed.text
        assert core.tokenizer.num_encode_calls == 1  # the refused one was never tokenized

    serve(core, body)
