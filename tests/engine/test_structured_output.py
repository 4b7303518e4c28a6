"""Structured outputs in the engine: the sampler's batched grammar mask, llguidance grammars over the default
model's tokenizer (errors naming the field, one compile per constraint, a sequence's state), and the offline
`LLM` API generating JSON that validates, one of a choice, and a regex match."""

from __future__ import annotations

import json
import re
import struct

import jsonschema
import pytest
import torch

from kiln import LLM, SamplingParams, StructuredOutput
from kiln.engine.sampler import Sampler, SamplingRow
from kiln.engine.structured_output import Grammars
from kiln.errors import RequestError
from kiln.model.build import load_tokenizer
from kiln.model.loader import open_checkpoint
from kiln.model.tokenizer import KilnTokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
        "tags": {"type": "array", "items": {"enum": ["port", "capital", "old"]}, "maxItems": 3},
    },
    "required": ["city", "population", "tags"],
    "additionalProperties": False,
}


def bitmask(allowed: set[int], vocab: int) -> torch.Tensor:
    """The grammar's mask layout: bit t % 32 of little-endian 32-bit word t // 32."""
    words = [0] * ((vocab + 31) // 32)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return torch.frombuffer(bytearray(struct.pack(f"<{len(words)}I", *words)), dtype=torch.int32)


def test_the_sampler_masks_constrained_rows_only() -> None:
    vocab, allowed = 70, {3, 31, 32, 63, 69}  # word edges, and bit 31 (the sign bit of an int32 word)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=gen)
    logits[:, 5] = 50.0  # the model's favourite, which the grammar forbids
    greedy, sampled = SamplingParams(temperature=0), SamplingParams(temperature=1.5)
    rows = [
        SamplingRow(greedy, [1], [], None, [], bitmask(allowed, vocab)),
        SamplingRow(greedy, [1], [], None, []),  # unconstrained, in the same batch
        SamplingRow(sampled, [1], [], torch.Generator().manual_seed(1), [], bitmask(allowed, vocab)),
    ]
    seen = set()
    for _ in range(300):
        out = Sampler()(logits.clone(), rows)
        assert out.token_ids[0] == max(allowed, key=lambda t: float(logits[0, t]))
        assert out.token_ids[1] == 5
        seen.add(out.token_ids[2])
    assert seen <= allowed and len(seen) > 1


@pytest.fixture(scope="module")
def tokenizer() -> KilnTokenizer:
    return load_tokenizer(open_checkpoint("default"))


@pytest.fixture(scope="module")
def grammars(tokenizer: KilnTokenizer) -> Grammars:
    return Grammars(tokenizer.tokenizer, 49152, (tokenizer.eos_token_id,))


def test_grammars_compile_once_and_refuse_bad_constraints_by_name(grammars: Grammars) -> None:
    json_constraint = StructuredOutput.json(SCHEMA, "response_format.json_schema.schema")
    assert grammars.compile(json_constraint) is grammars.compile(StructuredOutput.json(json.dumps(SCHEMA)))
    bad = [
        (StructuredOutput("regex", "[a-", "guided_regex"), "unclosed character class"),
        (StructuredOutput.json({"type": "thing"}, "guided_json"), "thing"),
        (StructuredOutput("json", "{not json", "guided_json"), "guided_json"),
        (StructuredOutput("grammar", "root ::= ( x", "guided_grammar"), "guided_grammar"),
    ]
    for constraint, why in bad:
        with pytest.raises(RequestError, match=re.escape(why)) as refused:
            grammars.compile(constraint)
        assert refused.value.param == constraint.param
    with pytest.raises(RequestError):
        StructuredOutput.choice([], "guided_choice")


def test_a_sequence_state_follows_its_tokens_and_completes(grammars: Grammars, tokenizer: KilnTokenizer) -> None:
    text = '{"city": "Oslo", "population": 709000, "tags": ["capital", "port"]}'
    state = grammars.start(StructuredOutput.json(SCHEMA))
    other = grammars.start(StructuredOutput.json(SCHEMA))  # its own copy: untouched by the first
    for token in tokenizer.encode(text, add_special_tokens=False):
        mask = grammars.bitmasks([state])[0]
        assert int(mask[token // 32]) >> (token % 32) & 1, tokenizer.decode([token])
        state.advance(token)
    assert state.is_complete and not other.is_complete
    with pytest.raises(RequestError, match="left the grammar"):
        other.advance(tokenizer.encode("hello", add_special_tokens=False)[0])


def test_the_llm_api_generates_what_the_constraint_asks(llm: LLM) -> None:
    ask = [{"role": "user", "content": "Describe a city as JSON."}]
    for temperature in (0.0, 0.9):
        params = SamplingParams(
            max_tokens=120, temperature=temperature, seed=3, structured_output=StructuredOutput.json(SCHEMA)
        )
        out = llm.chat(ask, params)[0]
        jsonschema.validate(json.loads(out.text), SCHEMA)
        assert out.finish_reason == "stop"
    choice = StructuredOutput.choice(["yes", "no"])
    outs = llm.generate(["Is water wet? Answer:", "Is fire cold? Answer:"], SamplingParams(structured_output=choice))
    assert all(o.text in ("yes", "no") and o.finish_reason == "stop" for o in outs)
    # the grammar ends the output even before min_tokens: nothing else could follow
    regex = SamplingParams(max_tokens=30, min_tokens=20, structured_output=StructuredOutput("regex", r"\d{3}"))
    out = llm.generate("Three digits:", regex)[0]
    assert re.fullmatch(r"\d{3}", out.text) and out.finish_reason == "stop"
