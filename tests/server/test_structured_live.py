"""Structured outputs on a live server over the default model, through the `openai` client: a held JSON schema
(nested objects, arrays, enums, bounded numbers) over 50 requests, streamed and not, greedy (agreeing but at
near-ties) and sampled; a pydantic model through `chat.completions.parse`; vLLM's guided_regex / guided_choice /
guided_grammar; bad constraints refused with a 400 naming them; a grammar longer than max_tokens ending with
"length"; logit_bias. Tool calls: tool_choice required and named hold the output to the tools' schemas; the Hermes
parser reads a teacher-forced output (the model held to the exact text by a regex), streamed and not; a history with
tool results; tool fields that do not fit refused with a 400 naming them. The server runs the default graph mode
(full_and_piecewise), as `kiln serve` does."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from kiln.model.build import load_tokenizer
from kiln.model.loader import open_checkpoint
from tests.server.live import LiveServer, cli_flags, live_server

MODEL = "SmolLM2-135M-Instruct.Q4_1"
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 1, "maximum": 120},
        "height_cm": {"type": "integer", "minimum": 50, "maximum": 250},
        "role": {"enum": ["knight", "wizard", "baker"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 3},
        "home": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "floor": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["city", "floor"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "height_cm", "role", "skills", "home"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Invent a fantasy character and describe them as JSON."}]


class Character(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    role: Literal["knight", "wizard", "baker"]
    level: int = pydantic.Field(ge=1, le=99)


NEAR_TIE = 0.25  # nats: a top-2 gap the kernel table's arithmetic per row class can flip (see below)


def assert_greedy_outputs_agree_but_at_near_ties(outputs: list[list[Any]]) -> None:
    """Greedy outputs of one request, sent at once, agree token for token, except after a near-tie. The same prompt
    runs in steps of different sizes, and the kernel table may compute each row class in its own timed arithmetic
    (int8 activations, bf16, the matrix unit), moving a logit by a few hundredths: where two outputs part, the token
    each took must be within NEAR_TIE of the other's in the first output's own logprobs. Rows mixed between requests
    or a grammar state shared by two of them would part at a token the model was sure of."""
    texts = ["".join(t.token for t in tokens) for tokens in outputs]
    reference = outputs[max(range(len(texts)), key=texts.count)]  # the most common output
    for tokens in outputs:
        at = next((k for k, (a, b) in enumerate(zip(reference, tokens, strict=False)) if a.token != b.token), None)
        if at is None:
            assert len(tokens) == len(reference), "one greedy output is a prefix of another"
            continue
        took, other = reference[at], tokens[at].token
        rivals = {alt.token: alt.logprob for alt in took.top_logprobs}
        assert other in rivals, (
            f"greedy outputs part at token {at}: {other!r} is not in the top 20 beside {took.token!r}"
        )
        gap = took.logprob - rivals[other]
        assert abs(gap) < NEAR_TIE, f"greedy outputs part at token {at} ({took.token!r} vs {other!r}), gap {gap:.3f}"


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    args = cli_flags(model_path="default", max_model_len=512, num_kv_blocks=512, max_num_seqs=16, seed=0)
    with live_server(args) as live:
        yield live


def test_50_requests_with_a_held_schema_all_validate(server: LiveServer) -> None:
    assert server.graph_mode() == "full_and_piecewise"  # as `kiln serve` runs
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)
    response_format = {"type": "json_schema", "json_schema": {"name": "character", "schema": SCHEMA, "strict": True}}

    async def one(i: int) -> tuple[str, str | None, list[Any]]:
        greedy = i % 4 < 2
        kwargs: dict[str, Any] = {"model": MODEL, "messages": ASK, "max_tokens": 200, "seed": i}
        kwargs |= {"temperature": 0 if greedy else 0.8, "response_format": response_format}
        if greedy:
            kwargs |= {"logprobs": True, "top_logprobs": 20}
        if i % 2 == 0:
            done = await client.chat.completions.create(**kwargs)
            choice = done.choices[0]
            tokens = choice.logprobs.content if choice.logprobs and choice.logprobs.content else []
            return choice.message.content or "", choice.finish_reason, tokens
        text, finish, tokens = "", None, []
        async for chunk in await client.chat.completions.create(**kwargs, stream=True):
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
                tokens += choice.logprobs.content if choice.logprobs and choice.logprobs.content else []
        return text, finish, tokens

    async def main() -> list[tuple[str, str | None, list[Any]]]:
        return await asyncio.gather(*(one(i) for i in range(50)))

    results = asyncio.run(main())
    for text, finish, _ in results:
        jsonschema.validate(json.loads(text), SCHEMA)  # raises with the path of what does not match
        assert finish == "stop", (finish, text)
    sampled = {text for i, (text, _, _) in enumerate(results) if i % 4 >= 2}
    assert len(sampled) > 1  # temperature 0.8 with different seeds: not one answer repeated
    greedy = [tokens for i, (_, _, tokens) in enumerate(results) if i % 4 < 2]
    assert_greedy_outputs_agree_but_at_near_ties(greedy)
    server.wait_idle()


def test_a_pydantic_model_through_parse(server: LiveServer) -> None:
    done = server.client().chat.completions.parse(
        model=MODEL, messages=ASK, response_format=Character, max_tokens=100, temperature=0
    )
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, Character) and 1 <= parsed.level <= 99


def test_guided_regex_choice_and_grammar_in_completions(server: LiveServer) -> None:
    client = server.client()
    regex = r"[A-Z][a-z]{2,8} (19|20)\d\d"
    done = client.completions.create(
        model=MODEL, prompt="A name and a year:", max_tokens=20, n=3, temperature=1.0, seed=5,
        extra_body={"guided_regex": regex},
    )  # fmt: skip
    assert len(done.choices) == 3
    for choice in done.choices:
        assert re.fullmatch(regex, choice.text), choice.text
        assert choice.finish_reason == "stop"
    choices = ["red", "green", "blue"]
    done = client.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=5, temperature=0, extra_body={"guided_choice": choices}
    )
    assert done.choices[0].text in choices
    gbnf = 'root ::= "(" [0-9]+ " + " [0-9]+ ")"'
    streamed = client.completions.create(
        model=MODEL, prompt="A sum:", max_tokens=20, temperature=0, stream=True, extra_body={"guided_grammar": gbnf}
    )
    text = "".join(c.choices[0].text for c in streamed if c.choices)
    assert re.fullmatch(r"\(\d+ \+ \d+\)", text), text
    any_object = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=120, temperature=0, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(any_object.choices[0].message.content or ""), dict)


def test_bad_constraints_are_400s_naming_them(server: LiveServer) -> None:
    def error(body: dict[str, Any], route: str = "chat/completions") -> dict[str, Any]:
        base = {"model": MODEL, "messages": ASK} if route == "chat/completions" else {"model": MODEL, "prompt": "x"}
        response = httpx.post(f"{server.base_url}/{route}", json={**base, **body}, timeout=60)
        assert response.status_code == 400, response.text
        return response.json()["error"]

    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "thing"}}}
    e = error({"response_format": bad_schema})
    assert e["param"] == "response_format.json_schema.schema" and "thing" in e["message"]
    e = error({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})
    assert e["param"] == "response_format.json_schema.schema"
    e = error({"guided_regex": "[a-"}, "completions")
    assert e["param"] == "guided_regex" and "regex" in e["message"]
    e = error({"guided_grammar": "root ::= ( unclosed"}, "completions")
    assert e["param"] == "guided_grammar"
    e = error({"guided_choice": []}, "completions")
    assert e["param"] == "guided_choice"
    e = error({"guided_regex": "a", "response_format": {"type": "json_object"}})
    assert "give one structured output" in e["message"] and e["param"] == "guided_regex"
    e = error({"response_format": {"type": "yaml"}})
    assert e["param"] == "response_format.type"
    server.wait_idle()


def test_a_grammar_longer_than_max_tokens_ends_with_length(server: LiveServer) -> None:
    done = server.client().completions.create(
        model=MODEL, prompt="Scream:", max_tokens=6, temperature=0, extra_body={"guided_regex": "A{200}"}
    )
    choice = done.choices[0]
    assert choice.finish_reason == "length" and re.fullmatch("A+", choice.text), choice


def test_logit_bias_through_the_openai_client(server: LiveServer) -> None:
    token = load_tokenizer(open_checkpoint("default")).encode(" banana", add_special_tokens=False)[0]
    client = server.client()
    ask = {"model": MODEL, "prompt": "My favourite fruit is", "max_tokens": 3, "temperature": 0}
    assert client.completions.create(**ask).choices[0].text != " banana" * 3
    biased = client.completions.create(**ask, logit_bias={str(token): 100})
    assert biased.choices[0].text == " banana" * 3
    for bad in ({"abc": 1}, {str(token): 101}, {"99999999": 1}):
        response = httpx.post(f"{server.base_url}/completions", json={**ask, "logit_bias": bad}, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == "logit_bias", response.text


# -- tool calls -------------------------------------------------------------------------------------------------
WEATHER_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather now in a city",
                                      "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD_PARAMETERS}},
]  # fmt: skip
PARAMETERS = {"get_weather": WEATHER_PARAMETERS, "add": ADD_PARAMETERS}
WEATHER = [{"role": "user", "content": "What is the weather in Paris? Then add 2 and 3."}]


def streamed_calls(chunks: Any) -> tuple[str, dict[int, dict[str, str]], str | None]:
    """A streamed answer's content, its calls by index (id, name and the joined arguments), its finish_reason."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            if delta.id:
                assert not call["id"], "a call's id and name come in its first delta only"
                call["id"], call["name"] = delta.id, delta.function.name
            call["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


def test_tool_choice_required_and_named_return_valid_calls(server: LiveServer) -> None:
    client = server.client()
    for temperature in (0.0, 0.9):
        ask = {"model": MODEL, "messages": WEATHER, "tools": TOOLS, "max_tokens": 120, "temperature": temperature,
               "seed": 3}  # fmt: skip
        done = client.chat.completions.create(**ask, tool_choice="required")
        message = done.choices[0].message
        # a small model may go on calling until max_tokens: then the whole calls so far are the answer
        assert done.choices[0].finish_reason in ("tool_calls", "length") and message.tool_calls, done
        for call in message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
            assert call.id.startswith("call_") and call.type == "function"
        content, calls, finish = streamed_calls(
            client.chat.completions.create(**ask, tool_choice="required", stream=True)
        )
        assert finish == done.choices[0].finish_reason and not content and calls
        # same seed: the same calls, token for token, streamed or not; cut off by max_tokens, the stream has already
        # sent the start of a last call that the whole message leaves out (it keeps whole calls only)
        streamed = [(c["name"], c["arguments"]) for c in calls.values()]
        whole = [(c.function.name, c.function.arguments) for c in message.tool_calls]
        assert streamed[: len(whole)] == whole and len(streamed) - len(whole) <= (finish == "length")
        one = client.chat.completions.create(
            **{**ask, "max_tokens": 200}, tool_choice="required", parallel_tool_calls=False
        )
        assert one.choices[0].finish_reason == "tool_calls" and len(one.choices[0].message.tool_calls or []) == 1
        named = client.chat.completions.create(**ask, tool_choice={"type": "function", "function": {"name": "add"}})
        calls_named = named.choices[0].message.tool_calls or []
        assert named.choices[0].finish_reason == "stop" and [c.function.name for c in calls_named] == ["add"]
        jsonschema.validate(json.loads(calls_named[0].function.arguments), ADD_PARAMETERS)


def test_required_with_a_pydantic_schema_that_has_definitions(server: LiveServer) -> None:
    class Place(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")  # else a small model adds keys until max_tokens
        city: str = pydantic.Field(max_length=20)

    class Trip(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        start: Place
        stops: list[Place] = pydantic.Field(max_length=2)

    tools = [{"type": "function", "function": {"name": "plan", "parameters": Trip.model_json_schema()}}]
    done = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Plan a trip from Oslo."}], tools=tools,
        tool_choice="required", parallel_tool_calls=False, max_tokens=150, temperature=0,
    )  # fmt: skip
    calls = done.choices[0].message.tool_calls or []
    assert done.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["plan"]
    Trip.model_validate_json(calls[0].function.arguments)


def test_the_hermes_parser_reads_a_teacher_forced_output_streamed_and_not(server: LiveServer) -> None:
    """The model is forced (a regex of the exact text) to write content then two calls in the Hermes format the
    fallback prompt asks for; `tool_choice: auto` reads them as the parser does any output."""
    written = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    )
    ask = {"model": MODEL, "messages": WEATHER, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 120,
           "temperature": 0, "extra_body": {"guided_regex": re.escape(written)}}  # fmt: skip
    client = server.client()
    done = client.chat.completions.create(**ask)
    message = done.choices[0].message
    assert done.choices[0].finish_reason == "tool_calls" and message.content == "Let me check.\n"
    got = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
    assert got == [("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 2, "b": 3})]
    content, calls, finish = streamed_calls(client.chat.completions.create(**ask, stream=True))
    assert finish == "tool_calls" and content == "Let me check.\n"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == got
    assert len({c["id"] for c in calls.values()}) == 2
    # the same text as plain content when tools are off (tool_choice none), and no tools in the prompt then
    plain = client.chat.completions.create(**{**ask, "tool_choice": "none"})
    assert plain.choices[0].message.content == written and plain.choices[0].finish_reason == "stop"
    bare = client.chat.completions.create(model=MODEL, messages=WEATHER, max_tokens=1)
    assert plain.usage.prompt_tokens == bare.usage.prompt_tokens < done.usage.prompt_tokens


def test_a_conversation_with_tool_results_continues(server: LiveServer) -> None:
    history = [
        *WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]  # fmt: skip
    done = server.client().chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert done.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert done.usage.prompt_tokens > 0 and done.usage.completion_tokens > 0


def test_tool_fields_that_do_not_fit_are_400s_naming_them(server: LiveServer) -> None:
    def error(body: dict[str, Any]) -> dict[str, Any]:
        sent = json.dumps({"model": MODEL, "messages": WEATHER, **body})  # ASCII: a lone surrogate as its escape
        headers = {"Content-Type": "application/json"}
        response = httpx.post(f"{server.base_url}/chat/completions", content=sent, headers=headers, timeout=60)
        assert response.status_code == 400, response.text
        return response.json()["error"]

    assert error({"tool_choice": "required"})["param"] == "tool_choice"
    unknown = error({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}})
    assert unknown["param"] == "tool_choice.function.name" and "fly" in unknown["message"]
    both = error({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}})
    assert both["param"] == "response_format"
    twice = error({"tools": [TOOLS[0], TOOLS[0]]})
    assert twice["param"] == "tools.1.function.name"
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "thing"}}}]
    assert error({"tools": bad, "tool_choice": "required"})["param"] == "tools"
    assert error({"tools": [{"type": "retrieval"}]})["param"] == "tools.0.type"
    lone = [{"type": "function", "function": {"name": "f", "description": "\ud800"}}]
    assert error({"tools": lone})["param"] == "tools.0"
    server.wait_idle()
