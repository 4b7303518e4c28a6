"""No request field is silently ignored: each field of OpenAI's request kiln does not implement is a 400 that names
it (`param`), before anything is tokenized; the same field at OpenAI's default, and `user`, change nothing. Over a
FakeCore, through the app `kiln serve` builds, with httpx and with the `openai` client."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from kiln.server.request_fields import ASKS_NOTHING, NO_OPS, NOT_SERVED
from tests.server.app_harness import Served, openai_error, serve
from tests.server.fake_core import FakeCore

CHAT = [{"role": "user", "content": "hi"}]
COMPLETION = {"prompt": "hi", "max_tokens": 3, "temperature": 0}
# one value of each field that asks kiln for something it does not do
ASKING = {
    "guided_decoding_backend": "xgrammar",
    "guided_whitespace_pattern": " ",
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "suffix": " the end",
    "prediction": {"type": "content", "content": "x"},
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "web_search_options": {},
    "store": True,
    "metadata": {"a": "b"},
    "service_tier": "flex",
    "use_beam_search": True,
    "length_penalty": 0.5,
    "echo": True,
}
MESSAGE_FIELDS = {"refusal", "annotations"}
# fields of /v1/chat/completions that /v1/completions refuses
CHAT_ONLY = {
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": "required",
    "parallel_tool_calls": False,
    "reasoning_effort": "high",
    "chat_template_kwargs": {"enable_thinking": False},
}


def test_every_field_not_served_has_a_value_that_asks_for_it() -> None:
    """The table of reasons and this test's values cover the same fields (a new entry needs a case here)."""
    assert set(ASKING) | set(CHAT_ONLY) | MESSAGE_FIELDS | {"continuous_usage_stats"} == set(NOT_SERVED)
    assert set(ASKS_NOTHING) <= set(NOT_SERVED)


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_fields_kiln_does_not_serve_are_400s_naming_them(route: str) -> None:
    core = FakeCore()
    base: dict[str, Any] = {"prompt": "hi"} if route == "completions" else {"messages": CHAT}

    async def body(s: Served) -> None:
        for field, value in ASKING.items():
            if route == "completions" and field == "echo":
                continue  # a field of /v1/completions (tests/server/test_prompt_logprobs_server.py)
            error = openai_error(await s.client.post(f"/v1/{route}", json={**base, field: value}), 400)
            assert error["param"] == field, (field, error)
            assert f"{field}: {NOT_SERVED[field]}; remove the field" in error["message"]
        for field, value in CHAT_ONLY.items() if route == "completions" else ():  # chat: tests/server/test_tools.py
            error = openai_error(await s.client.post(f"/v1/{route}", json={**base, field: value}), 400)
            assert error["param"] == field and "served by /v1/chat/completions" in error["message"], error
        unknown = openai_error(await s.client.post(f"/v1/{route}", json={**base, "temprature": 0.5}), 400)
        assert unknown["param"] == "temprature" and "check its spelling" in unknown["message"]
        nested = {**base, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        error = openai_error(await s.client.post(f"/v1/{route}", json=nested), 400)
        assert error["param"] == "stream_options.continuous_usage_stats"
        assert core.tokenizer.num_encode_calls == 0  # refused before anything was tokenized or queued
        assert not core.requests

    serve(core, body)


def test_fields_at_their_default_and_no_ops_change_nothing() -> None:
    """What SDKs and clients send unasked: null, OpenAI's defaults, `user`. The answer is the same as without."""
    core = FakeCore()
    defaults: dict[str, Any] = {field: values[0] for field, values in ASKS_NOTHING.items()}
    defaults.pop("annotations")  # a message field
    defaults |= {"guided_json": None, "response_format": {"type": "text"}, "logit_bias": {}, "user": "user-1234"}
    assert set(NO_OPS) <= set(defaults)
    message = {**CHAT[0]}
    echoed = {"role": "assistant", "content": "hello", "tool_calls": None, "refusal": None, "annotations": []}

    async def body(s: Served) -> None:
        plain = await s.client.post("/v1/completions", json=COMPLETION)
        dressed = await s.client.post("/v1/completions", json={**COMPLETION, **defaults})
        assert plain.status_code == dressed.status_code == 200, dressed.text
        assert plain.json()["choices"] == dressed.json()["choices"]
        chat = {"messages": [message, echoed, message], "max_tokens": 3, "temperature": 0}
        plain = await s.client.post("/v1/chat/completions", json=chat)
        dressed = await s.client.post("/v1/chat/completions", json={**chat, **defaults})
        assert plain.status_code == dressed.status_code == 200, dressed.text
        assert plain.json()["choices"] == dressed.json()["choices"]

    serve(core, body)


def test_history_with_tool_calls_is_taken_and_its_mistakes_are_400s_where_they_stand() -> None:
    core = FakeCore(num_blocks=256, max_model_len=1024)
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"city": "Oslo"}'}}
    history = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    broken_call = {**call, "function": {"name": "f", "arguments": "city=Oslo"}}
    mistakes = {
        "messages.1.tool_calls.0.function.arguments": [history[0], {**history[1], "tool_calls": [broken_call]}],
        "messages.2": [*history[:2], {"role": "tool", "content": "sunny"}],
        "messages.0.tool_calls": [{**history[0], "tool_calls": [call]}],
    }

    async def body(s: Served) -> None:
        taken = await s.client.post("/v1/chat/completions", json={"messages": history, "max_tokens": 2})
        assert taken.status_code == 200, taken.text
        for param, messages in mistakes.items():
            error = openai_error(await s.client.post("/v1/chat/completions", json={"messages": messages}), 400)
            assert error["param"] == param, (param, error)
        image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]
        error = openai_error(await s.client.post("/v1/chat/completions", json={"messages": image}), 400)
        assert error["param"] == "messages.0.content.0.type" and "kiln serves text only" in error["message"]
        assert core.tokenizer.num_encode_calls == 1  # only the good history was tokenized

    serve(core, body)


def test_the_openai_client_gets_a_bad_request_error_naming_the_field() -> None:
    """A field kiln refuses, through the `openai` client: OpenAI's older `functions` (`tools`, `response_format`
    and `logit_bias` are served: tests/server/test_tools.py, tests/server/test_structured_live.py)."""
    core = FakeCore()

    async def body(s: Served) -> None:
        client = openai.AsyncOpenAI(api_key="none", base_url="http://localhost/v1", http_client=s.client, max_retries=0)
        asks: list[dict[str, Any]] = [
            {"functions": [{"name": "f", "parameters": {"type": "object"}}]},
        ]
        for ask in asks:
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(model="default", messages=CHAT, **ask)  # type: ignore[call-overload]
            assert refused.value.param in ask and "not implemented" in refused.value.message
        done = await client.chat.completions.create(model="default", messages=CHAT, max_tokens=2, user="u-1")  # type: ignore[arg-type]
        assert done.choices[0].message.content is not None

    serve(core, body)
