"""Grammars llguidance cannot serve are refused when compiled, not at their first token (issue 51): a 2,000-choice
list is served, recursive or unsatisfiable `$ref`s, an anyOf of 5,000 objects and doubling Lark rules are refused
in one short line with no parser state or grammar text, a refused constraint is not compiled twice, and the cache
stays within its bytes over a churn of distinct schemas, with the memory of what it evicts returned. Over the default
model's tokenizer."""

from __future__ import annotations

import json
import os

import pytest

from kiln.engine.structured import structured_output
from kiln.engine.structured.constraint import StructuredOutput
from kiln.engine.structured.grammar_build import GrammarRefused, short_reason
from kiln.engine.structured.grammar_cache import estimated_bytes
from kiln.engine.structured.structured_output import Grammars
from kiln.errors import RequestError
from kiln.model.build import load_tokenizer
from kiln.model.loader import open_checkpoint
from kiln.model.tokenizer import KilnTokenizer

DOUBLING = "start: r0\n" + "\n".join(f"r{i}: r{i + 1} r{i + 1}" for i in range(60)) + '\nr60: "a"\n'
UNSERVABLE = {
    "recursive $ref": StructuredOutput.json({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
    "unsatisfiable $ref": StructuredOutput.json({"type": "array", "items": {"$ref": "#"}, "minItems": 1}),
    "anyOf of 2,500 objects": StructuredOutput.json(
        {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}} for i in range(2500)]}
    ),
    "60 doubling rules": StructuredOutput("grammar", DOUBLING, "guided_grammar"),
}


@pytest.fixture(scope="module")
def tokenizer() -> KilnTokenizer:
    return load_tokenizer(open_checkpoint("default"))


def new_grammars(tokenizer: KilnTokenizer, cache_bytes: int = 256 << 20) -> Grammars:
    return Grammars(tokenizer.tokenizer, 49152, (tokenizer.eos_token_id,), cache_bytes)


def test_a_2000_choice_list_is_served_to_its_end(tokenizer: KilnTokenizer) -> None:
    grammars = new_grammars(tokenizer)
    choices = [f"item number {i}" for i in range(2000)]
    state = grammars.start(StructuredOutput.choice(choices, "guided_choice"))
    # NOTE: with every choice an alternative of the start rule, the row after the first token had 2,001 items
    for token in tokenizer.encode(choices[1234], add_special_tokens=False):
        mask = grammars.bitmasks([state])[0]
        assert int(mask[token // 32]) >> (token % 32) & 1
        state.advance(token)
    assert state.is_complete
    other = grammars.start(StructuredOutput.choice(choices, "guided_choice"))
    with pytest.raises(RequestError, match="left the grammar of guided_choice") as left:
        other.advance(tokenizer.encode("{", add_special_tokens=False)[0])
    assert left.value.param == "guided_choice" and "<state>" not in str(left.value) and "item" not in str(left.value)


@pytest.mark.parametrize("name", sorted(UNSERVABLE))
def test_grammars_llguidance_cannot_serve_are_refused_at_compile_time(tokenizer: KilnTokenizer, name: str) -> None:
    grammars = new_grammars(tokenizer)
    constraint = UNSERVABLE[name]
    with pytest.raises(GrammarRefused) as refused:
        grammars.compile(constraint)
    message = str(refused.value)
    assert refused.value.param == constraint.param and message.startswith(f"{constraint.param} cannot be")
    assert "\n" not in message and len(message) < 400
    assert "<state>" not in message and "$defs" not in message and "r59" not in message


def test_a_refused_constraint_is_not_compiled_again(tokenizer: KilnTokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    grammars = new_grammars(tokenizer)
    constraint = UNSERVABLE["recursive $ref"]
    with pytest.raises(GrammarRefused):
        grammars.compile(constraint)
    calls: list[str] = []
    monkeypatch.setattr(structured_output, "new_matcher", lambda *args: calls.append("compiled"))
    with pytest.raises(GrammarRefused, match="cannot be served"):
        grammars.compile(StructuredOutput.json(json.loads(constraint.spec)))  # an equal constraint, built anew
    assert calls == []


def test_a_panic_inside_llguidance_is_never_quoted() -> None:
    class PanicException(BaseException):  # pyo3's class for a Rust panic
        pass

    reason = short_reason(PanicException("thread panicked at src/earley/parser.rs:42: index out of bounds\nbacktrace"))
    assert reason == "the grammar compiler failed on it"


def test_the_cache_stays_within_its_bytes_over_a_churn_of_schemas(tokenizer: KilnTokenizer) -> None:
    def schema(i: int) -> StructuredOutput:
        return StructuredOutput.json({"enum": [f"value {i} {j}" for j in range(2000)]})

    one = estimated_bytes(json.dumps([f"value 0 {j}" for j in range(2000)]))
    grammars = new_grammars(tokenizer, cache_bytes=3 * one + one // 2)
    for i in range(10):
        grammars.compile(schema(i))
        assert grammars.cache.num_bytes <= grammars.cache.max_bytes
    assert 2 <= len(grammars.cache) <= 3 and grammars.cache.num_evicted >= 7
    assert grammars.cache.get(schema(9).key) is not None and grammars.cache.get(schema(0).key) is None
    too_large = new_grammars(tokenizer, cache_bytes=one // 4)
    with pytest.raises(GrammarRefused, match="--grammar-cache-mb"):
        too_large.compile(schema(0))


def test_memory_returns_after_eviction_over_a_churn_of_large_schemas(tokenizer: KilnTokenizer) -> None:
    """RSS stays flat while 30 more distinct 20,000-value enums pass through a 3-grammar cache: evicted matchers
    are freed (each such grammar holds ~7 MB; kept, the 30 would add ~200 MB)."""

    def schema(i: int) -> StructuredOutput:
        return StructuredOutput.json({"enum": [f"value {i} {j}" for j in range(20_000)]})

    def rss_mb() -> float:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    one = estimated_bytes(json.dumps([f"value 0 {j}" for j in range(20_000)]))
    grammars = new_grammars(tokenizer, cache_bytes=3 * one)
    for i in range(10):  # the cache fills and the allocator reaches its working size
        grammars.compile(schema(i))
    settled = rss_mb()
    for i in range(10, 40):
        grammars.compile(schema(i))
    assert grammars.cache.num_evicted >= 35
    assert rss_mb() - settled < 40, (settled, rss_mb())
