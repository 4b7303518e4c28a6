"""Structured outputs cannot stop admission (issue 51): constraints over the size limits are refused before any
compile, compiles run on their own pool (not the tokenizer thread every request waits on), a compile past the
deadline answers 400 naming its flag and is refused at once when sent again, and one client's compiles run one
at a time, so they cannot take every thread. Over a FakeCore with a grammar compiler that blocks on demand."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading

import pytest

from kiln.engine.request import RequestOutput
from kiln.engine.structured.constraint import StructuredOutput
from kiln.engine.structured.grammar_build import GrammarRefused
from kiln.engine.structured.grammar_cache import GrammarCache
from kiln.server.answers import raise_if_failed
from kiln.server.errors import APIError
from kiln.server.grammar_compiler import GrammarCompiler
from kiln.server.grammar_limits import GrammarLimits
from kiln.server.limits import LimitExceeded
from tests.server.app_harness import Served, openai_error, serve, wait_until
from tests.server.fake_core import FakeCore

CHAT = [{"role": "user", "content": "hi"}]
HOLD_S = 30.0  # a held compile waits at most this long for its release


class HeldGrammars:
    """Grammars whose compile blocks until `release` is set; a spec containing "bad" is then refused."""

    def __init__(self) -> None:
        self.cache = GrammarCache()
        self.release = threading.Event()
        self.compiled: list[str] = []
        self.threads: set[str] = set()
        self._lock = threading.Lock()

    def compile(self, constraint: StructuredOutput) -> object:
        with self._lock:
            self.compiled.append(constraint.spec)
            self.threads.add(threading.current_thread().name)
        self.release.wait(HOLD_S)
        if "bad" in constraint.spec:
            raise GrammarRefused(f"{constraint.param} cannot be used: refused", None, constraint.param)
        matcher = object()
        self.cache.put(constraint.key, matcher, 1)
        return matcher

    def remember_failure(self, constraint: StructuredOutput, message: str) -> None:
        self.cache.fail(constraint.key, message)


def held_core() -> tuple[FakeCore, HeldGrammars]:
    core, grammars = FakeCore(), HeldGrammars()
    core.grammars = grammars  # type: ignore[assignment]
    return core, grammars


def test_size_limits_refuse_before_compiling() -> None:
    limits = GrammarLimits(max_bytes=20_000, max_choices=2_000, max_depth=8)
    limits.check(StructuredOutput.choice([f"c{i}" for i in range(2_000)], "guided_choice"))
    bombs = {
        "--max-grammar-choices": StructuredOutput.choice([f"c{i}" for i in range(2_001)], "guided_choice"),
        "--max-grammar-bytes": StructuredOutput("regex", "a" * 20_001, "guided_regex"),
        "--max-schema-depth": StructuredOutput.json(_nested(9), "guided_json"),
    }
    enum_schema = {"anyOf": [{"enum": [f"v{i}" for i in range(1_100)]}, {"enum": [f"w{i}" for i in range(1_000)]}]}
    bombs["--max-grammar-choices "] = StructuredOutput.json(enum_schema, "guided_json")  # counted across the schema
    for flag, constraint in bombs.items():
        with pytest.raises(LimitExceeded, match=flag.strip()) as refused:
            limits.check(constraint)
        assert refused.value.code == "grammar_too_large" and refused.value.param == constraint.param
    limits.check(StructuredOutput.json(_nested(8), "guided_json"))


def _nested(depth: int) -> dict[str, object]:
    """A schema whose JSON nests `depth` containers deep."""
    schema: dict[str, object] = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"not": schema}
    return schema


def test_a_compiling_grammar_does_not_hold_other_requests() -> None:
    core, grammars = held_core()

    async def body(s: Served) -> None:
        bomb = asyncio.ensure_future(
            s.client.post("/v1/chat/completions", json={"messages": CHAT, "guided_choice": ["bad", "worse"]})
        )
        await wait_until(lambda: bool(grammars.compiled))
        # NOTE: before issue 51 the grammar compiled on the tokenizer thread, so this waited for its release
        plain = await asyncio.wait_for(s.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}), 10)
        assert plain.status_code == 200 and not bomb.done()
        grammars.release.set()
        error = openai_error(await bomb, 400)
        assert error["type"] == "invalid_request_error" and error["param"] == "guided_choice"
        assert "kiln-tokenize" not in " ".join(grammars.threads)

    serve(core, body)


def test_a_compile_past_the_deadline_is_a_400_and_refused_at_once_again() -> None:
    core, grammars = held_core()
    ask = {"messages": CHAT, "guided_regex": "slow|slower"}

    async def body(s: Served) -> None:
        late = await s.client.post("/v1/chat/completions", json=ask)
        error = openai_error(late, 400)
        assert error["code"] == "grammar_compile_timeout" and "--grammar-compile-timeout=0.3" in error["message"]
        assert late.headers["x-request-id"] in error["message"]
        again = await asyncio.wait_for(s.client.post("/v1/chat/completions", json=ask), 2)
        assert openai_error(again, 400)["param"] == "guided_regex"
        assert grammars.compiled == ["slow|slower"]  # the repeat was not compiled again
        grammars.release.set()

    serve(core, body, ["--grammar-compile-timeout", "0.3"])


def test_one_clients_compiles_take_one_thread_at_a_time() -> None:
    grammars = HeldGrammars()
    compiler = GrammarCompiler(grammars, GrammarLimits(compile_timeout_s=HOLD_S), num_threads=2)  # type: ignore[arg-type]

    async def main() -> None:
        bombs = [
            asyncio.ensure_future(compiler.compile(StructuredOutput("regex", f"a{i}"), "10.0.0.1", f"r{i}"))
            for i in range(4)
        ]
        await wait_until(lambda: len(grammars.compiled) == 1)
        other = asyncio.ensure_future(compiler.compile(StructuredOutput("regex", "b"), "10.0.0.2", "rb"))
        await wait_until(lambda: "b" in grammars.compiled)  # the second thread is still free for another client
        assert len(grammars.compiled) == 2
        grammars.release.set()
        await asyncio.gather(other, *bombs)
        assert sorted(grammars.compiled) == ["a0", "a1", "a2", "a3", "b"]

    try:
        asyncio.run(main())
    finally:
        grammars.release.set()
        compiler.close()


def test_bombs_over_the_limits_never_reach_the_compiler() -> None:
    core, grammars = held_core()
    grammars.release.set()
    choices = [f"choice {i}" for i in range(100_000)]  # ~1 MB: held the server 32 s before issue 51

    async def body(s: Served) -> None:
        refused = await s.client.post("/v1/chat/completions", json={"messages": CHAT, "guided_choice": choices})
        error = openai_error(refused, 400)
        assert error["code"] == "grammar_too_large" and "--max-grammar-choices" in error["message"]
        assert "choice 1" not in refused.text and len(refused.text) < 400
        served = await s.client.post("/v1/chat/completions", json={"messages": CHAT, "guided_choice": choices[:2000]})
        assert served.status_code == 200, served.text
        assert grammars.compiled == [json.dumps(choices[:2000])]

    serve(core, body, ["--max-body-bytes", str(4 << 20)])


def test_a_grammar_that_fails_mid_output_is_the_clients_400_not_a_500() -> None:
    failed = RequestOutput(
        "cmpl-1-0", None, [1], "", [], True, "error", error="the output left the grammar of guided_json: refused"
    )
    with pytest.raises(APIError) as grammar:
        raise_if_failed(dataclasses.replace(failed, error_param="guided_json"), "req-1")
    assert grammar.value.status == 400 and grammar.value.param == "guided_json"
    assert grammar.value.code == "grammar_failed" and "req-1" in grammar.value.message
    with pytest.raises(APIError) as engine:  # any other failure stays the engine's
        raise_if_failed(failed, "req-2")
    assert engine.value.status == 500
