"""Structured outputs in the engine: the sampler's batched grammar mask, llguidance grammars over the default
model's tokenizer (errors naming the field, one compile per constraint, a sequence's state), and the offline
`LLM` API generating JSON that validates, one of a choice, and a regex match."""

from __future__ import annotations

import json
import math
import re
import struct
from types import SimpleNamespace

import jsonschema
import pytest
import torch

from kiln import LLM, SamplingParams, StructuredOutput
from kiln.config import SpeculativeConfig
from kiln.engine.request import Request
from kiln.engine.running.step_sample import sample_step
from kiln.engine.sampling.sampler import Sampler, SamplingRow
from kiln.engine.scheduling.scheduler_output import ScheduledRequest
from kiln.engine.speculation.speculation import Speculator
from kiln.engine.structured.structured_output import Grammars
from kiln.errors import RequestError
from kiln.model.build import load_tokenizer
from kiln.model.loader import open_checkpoint
from kiln.model.tokenizer import KilnTokenizer
from kiln.server.protocol import ChatCompletionRequest

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


# -- with speculative decoding ---------------------------------------------------------------------------------
def test_drafts_are_cut_where_the_grammar_refuses_them_and_masked_per_position(
    grammars: Grammars, tokenizer: KilnTokenizer
) -> None:
    state = grammars.start(StructuredOutput("regex", r"ab[0-9]{3}"))
    ab, one, two, three = tokenizer.encode("ab123", add_special_tokens=False)
    x = tokenizer.encode("x", add_special_tokens=False)[0]
    assert state.drafts_within([ab, one, x, two], keep_refused=False) == [ab, one]
    assert state.drafts_within([ab, one, x, two], keep_refused=True) == [ab, one, x]  # a sampled draft's rule
    assert state.drafts_within([ab, one, two, three], keep_refused=True) == [ab, one, two, three]
    assert state.drafts_within([x, ab], keep_refused=False) == []
    other = grammars.start(StructuredOutput.json(SCHEMA))
    rows = grammars.bitmasks([state, other], [[ab, one, x], []])  # 1 + 3 rows, then 1
    assert rows.shape[0] == 5
    assert torch.equal(rows[4], grammars.bitmasks([other])[0])
    assert torch.equal(rows[0], grammars.bitmasks([state])[0])  # the state did not move: only "ab" allowed
    assert int(rows[0][ab // 32]) >> (ab % 32) & 1 and not int(rows[0][one // 32]) >> (one % 32) & 1
    for token, row in ((ab, 1), (one, 2)):  # each draft row: the mask as decoding up to there gives it
        state.advance(token)
        assert torch.equal(rows[row], grammars.bitmasks([state])[0])
    assert bool((rows[3] == -1).all())  # after the refused draft: no verification reaches it, nothing masked


def test_the_speculator_cuts_a_structured_outputs_drafts(grammars: Grammars, tokenizer: KilnTokenizer) -> None:
    ab, one, two = tokenizer.encode("ab12", add_special_tokens=False)
    x = tokenizer.encode("x", add_special_tokens=False)[0]
    config = SpeculativeConfig("ngram", num_speculative_tokens=4, prompt_lookup_min=1, policy="always")
    spec = Speculator(config, max_model_len=99)
    greedy = SamplingParams(max_tokens=9, temperature=0)
    reqs = [Request(rid, None, [x, ab, one, two] * 2 + [x], greedy, None) for rid in ("free", "cut", "refused")]
    reqs[1].grammar = grammars.start(StructuredOutput("regex", r"ab[0-9]{3}"))
    reqs[2].grammar = grammars.start(StructuredOutput("regex", r"[0-9]+"))
    drafts = spec.propose(reqs).tokens  # the same proposal for each: what followed the earlier "x ab 1 2 x"
    assert drafts == {"free": [ab, one, two, x], "cut": [ab, one, two]}  # "refused": its first draft is not allowed


PEOPLE = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "maximum": 120}},
                "required": ["name", "age"],
                "additionalProperties": False,
            },
            "minItems": 4,
            "maxItems": 4,
        }
    },
    "required": ["people"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_structured_outputs_speculate_and_keep_their_tokens(llm: LLM, method: str) -> None:
    """Drafts verified under the grammar (n-gram: the schema's keys repeat; the model as its own draft: its
    unconstrained picks, cut or rejected where the grammar refuses them): greedy tokens as without speculation,
    sampled outputs valid."""
    draft = dict(speculative_model="default") if method == "draft" else {}
    spec_llm = LLM(
        "default", dtype="float32", seed=0, quantization="none", graph_mode="eager", speculative_method=method,
        speculative_policy="always", **draft,
    )  # fmt: skip
    ask = [{"role": "user", "content": "List four people with their ages as JSON."}]
    greedy = SamplingParams(max_tokens=90, temperature=0, structured_output=StructuredOutput.json(PEOPLE))
    plain, held = llm.chat(ask, greedy)[0], spec_llm.chat(ask, greedy)[0]
    assert held.token_ids == plain.token_ids and held.finish_reason == plain.finish_reason == "stop"
    jsonschema.validate(json.loads(held.text), PEOPLE)
    stats = spec_llm.engine.speculator.stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    constraint = StructuredOutput.json(PEOPLE)
    sampled = [SamplingParams(max_tokens=90, temperature=0.8, seed=s, structured_output=constraint) for s in (5, 6)]
    accepted = stats.num_accepted_tokens
    for out in spec_llm.chat([ask, ask], sampled):
        jsonschema.validate(json.loads(out.text), PEOPLE)
    assert stats.num_accepted_tokens > accepted


# -- sampled first, masked only when refused ---------------------------------------------------------------------
def sample_choice_rows(
    grammars: Grammars, tokenizer: KilnTokenizer, params: list[SamplingParams], favourites: list[dict[int, float]]
) -> list[int]:
    """One sampling step of rows constrained to "yes" or "no", row i's logits log(prob) at `favourites[i]`'s tokens
    (every other token far below them)."""
    choice = StructuredOutput.choice(["yes", "no"])
    reqs = []
    for i, p in enumerate(params):
        req = Request(str(i), None, [1], p, torch.Generator().manual_seed(i))
        req.grammar = grammars.start(choice)
        reqs.append(req)
    logits = torch.full((len(reqs), 49152), -30.0)
    for i, probs in enumerate(favourites):
        for token, prob in probs.items():
            logits[i, token] = math.log(prob)
    sched = SimpleNamespace(scheduled=[ScheduledRequest(r, 1) for r in reqs])
    plan = SimpleNamespace(sample_request_ids=[r.request_id for r in reqs])
    out = sample_step(Sampler(), sched, plan, logits, eos_token_ids=[tokenizer.eos_token_id], draft_probs={})
    return [out.sampled[r.request_id][0] for r in reqs]


def test_rows_sample_before_their_mask_and_keep_the_masked_distribution(
    grammars: Grammars, tokenizer: KilnTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A greedy or temperature-only row samples without its grammar mask and computes the mask only when the grammar
    refuses the token: greedy gives the likeliest allowed token, sampled rows the masked distribution (chi-square
    over 2,000 draws), and rows whose first token is allowed compute no mask."""
    yes, no, maybe, ok = (tokenizer.encode(w, add_special_tokens=False)[0] for w in ("yes", "no", "maybe", "ok"))
    masked_rows: list[int] = []  # the rows of each mask computation
    bitmasks = Grammars.bitmasks

    def counted(self: Grammars, states: list, drafts: list | None = None) -> torch.Tensor:
        masked_rows.append(len(states))
        return bitmasks(self, states, drafts)

    monkeypatch.setattr(Grammars, "bitmasks", counted)

    def step(params: list[SamplingParams], favourites: list[dict[int, float]]) -> list[int]:
        return sample_choice_rows(grammars, tokenizer, params, favourites)

    greedy = SamplingParams(temperature=0)
    assert step([greedy, greedy], [{maybe: 0.5, no: 0.3, yes: 0.2}, {yes: 0.6, maybe: 0.4}]) == [no, yes]
    assert masked_rows == [1]  # the first row alone was refused ("maybe") and masked
    masked_rows.clear()
    mass = {maybe: 0.4, yes: 0.3, ok: 0.2, no: 0.1}  # the grammar allows yes and no: 3/4 and 1/4 of their mass
    tokens = []
    for _ in range(5):
        tokens += step([SamplingParams(temperature=1.0, seed=None)] * 400, [mass] * 400)
    counts = torch.tensor([tokens.count(yes), tokens.count(no)], dtype=torch.float64)
    assert int(counts.sum()) == len(tokens)  # every token allowed
    expected = torch.tensor([0.75, 0.25], dtype=torch.float64) * len(tokens)
    assert float(((counts - expected) ** 2 / expected).sum()) < 10.83  # chi-square, 1 dof, p = 0.001
    refused = sum(masked_rows) / len(tokens)
    assert 0.5 < refused < 0.7  # masks for the rows whose first draw was refused (0.6 of the mass) only


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_p=0.8)]
)
def test_top_k_and_top_p_rows_sample_the_masked_distribution(
    params: SamplingParams, grammars: Grammars, tokenizer: KilnTokenizer
) -> None:
    """Top-k and top-p apply to the *allowed* tokens: the grammar's mask comes first. Sampling such a row unmasked and
    masking only when the grammar refuses would draw "yes" with probability 6/7 (top-k 2 keeps maybe and yes) or
    5/6 (top-p 0.8 keeps maybe, yes and ok) instead of the masked 3/4; a chi-square over 2,000 draws tells them
    apart (it reads ~120 and ~75 for those shortcuts, p = 0.001 at 10.83)."""
    yes, no, maybe, ok = (tokenizer.encode(w, add_special_tokens=False)[0] for w in ("yes", "no", "maybe", "ok"))
    mass = {maybe: 0.4, yes: 0.3, ok: 0.2, no: 0.1}  # allowed: yes and no, 3/4 and 1/4 of their mass
    tokens = []
    for _ in range(5):
        tokens += sample_choice_rows(grammars, tokenizer, [params] * 400, [mass] * 400)
    counts = torch.tensor([tokens.count(yes), tokens.count(no)], dtype=torch.float64)
    assert int(counts.sum()) == len(tokens)  # every token allowed
    expected = torch.tensor([0.75, 0.25], dtype=torch.float64) * len(tokens)
    assert float(((counts - expected) ** 2 / expected).sum()) < 10.83, counts.tolist()


# -- vLLM's request fields, to the engine ------------------------------------------------------------------------
LARK = 'start: "Answer: " DIGITS " apples"\nDIGITS: /[1-9][0-9]/'
SMALL_SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer"}},
    "required": ["n"],
    "additionalProperties": False,
}


def test_vllms_structured_outputs_object_and_a_lark_guided_grammar_reach_the_engine(llm: LLM) -> None:
    """The README's vLLM fields: `structured_outputs` ({json | regex | choice | grammar | json_object}) and
    `guided_grammar` in Lark (not only GBNF), from a request body to what the model generates (one batch)."""
    ask = [{"role": "user", "content": "How many apples?"}]
    grammar = lambda text: re.fullmatch(r"Answer: [1-9][0-9] apples", text) is not None  # noqa: E731
    cases = {  # the field's body -> what its output must be
        "json": ({"json": SMALL_SCHEMA}, lambda text: jsonschema.validate(json.loads(text), SMALL_SCHEMA) is None),
        "regex": ({"regex": r"[a-z]{4}-\d"}, lambda text: re.fullmatch(r"[a-z]{4}-\d", text) is not None),
        "choice": ({"choice": ["red", "green"]}, lambda text: text in ("red", "green")),
        "grammar": ({"grammar": LARK}, grammar),
        "json_object": ({"json_object": True}, lambda text: isinstance(json.loads(text), dict)),
    }
    bodies = {name: {"structured_outputs": fields} for name, (fields, _) in cases.items()}
    bodies["guided_grammar"] = {"guided_grammar": LARK}
    checks = {name: check for name, (_, check) in cases.items()} | {"guided_grammar": grammar}
    params = []
    for name, fields in bodies.items():
        constraint = ChatCompletionRequest.model_validate({"messages": ask, **fields}).structured_output()
        assert constraint is not None, name
        assert constraint.param == ("guided_grammar" if name == "guided_grammar" else f"structured_outputs.{name}")
        params.append(SamplingParams(max_tokens=60, temperature=0, structured_output=constraint))
    outs = llm.chat([ask] * len(params), params)
    for (name, check), out in zip(checks.items(), outs, strict=True):
        assert out.finish_reason == "stop" and check(out.text), (name, out.text)
