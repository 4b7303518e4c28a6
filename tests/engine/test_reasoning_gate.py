"""A reasoning model's structured output is held to its grammar after its reasoning (kiln.engine.structured.
structured_output.ReasoningGate): the reasoning's tokens are free, the answer matches the grammar."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.engine.structured.constraint import StructuredOutput
from kiln.engine.structured.reasoning_gate import ReasoningGate
from kiln.engine.structured.structured_output import Grammars
from kiln.model.build import load_tokenizer
from kiln.model.loader import open_checkpoint
from kiln.model.tokenizer import KilnTokenizer
from kiln.server.reasoning import REASONING_PARSERS, reasoning_gate

CHOICES = ["yes", "no"]


@pytest.fixture(scope="module")
def tokenizer() -> KilnTokenizer:
    return load_tokenizer(open_checkpoint("default"))


@pytest.fixture(scope="module")
def grammars(tokenizer: KilnTokenizer) -> Grammars:
    return Grammars(tokenizer.tokenizer, 49152, (tokenizer.eos_token_id,))


def ids(tokenizer: KilnTokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def allowed(row: torch.Tensor, token: int) -> bool:
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


def choice(gate: ReasoningGate | None) -> StructuredOutput:
    return StructuredOutput("choice", '["yes", "no"]', after_reasoning=gate)


def test_the_reasoning_is_free_and_the_grammar_holds_from_the_token_after_its_end(
    tokenizer: KilnTokenizer, grammars: Grammars
) -> None:
    end = ids(tokenizer, "</think>")
    thinking = ids(tokenizer, "Let me think: maybe")
    state = grammars.start(choice(ReasoningGate(tuple(end), inside=True)))
    held = grammars.start(choice(None))  # the same grammar from the first token
    maybe = thinking[-1]
    assert not held.allows(maybe) and state.allows(maybe) and not state.is_held
    assert bool((grammars.bitmasks([state]) == -1).all())  # the reasoning's rows mask nothing
    drafts = [*thinking, *end, *ids(tokenizer, "yes")]
    assert state.drafts_within(drafts, keep_refused=False) == [*thinking, *end]  # drafts stop where it closes
    rows = grammars.bitmasks([state, held], [[*thinking, *end], []])
    after_end, fresh = rows[len(thinking) + len(end)], rows[-1]
    assert torch.equal(after_end, fresh)  # the row after the closing tag is the grammar's first mask
    assert bool((rows[: len(thinking) + len(end)] == -1).all())
    for token in [*thinking, *end]:
        state.advance(token)
    assert state.is_held and not state.allows(maybe) and state.allows(ids(tokenizer, "yes")[0])
    assert torch.equal(grammars.bitmasks([state])[0], fresh)


def test_an_output_may_open_a_reasoning_with_its_first_token(tokenizer: KilnTokenizer, grammars: Grammars) -> None:
    start, end = ids(tokenizer, " think")[0], ids(tokenizer, "</think>")
    opened, answered = (grammars.start(choice(ReasoningGate(tuple(end), start=start))) for _ in range(2))
    maybe = ids(tokenizer, " maybe")[0]
    assert opened.allows(start) and not opened.allows(maybe) and opened.allows(ids(tokenizer, "no")[0])
    row = grammars.bitmasks([opened])[0]
    held = grammars.bitmasks([grammars.start(choice(None))])[0]
    assert allowed(row, start) and not allowed(held, start)
    assert all(allowed(row, t) == allowed(held, t) for t in range(49152) if t != start)
    opened.advance(start)  # a reasoning, then the answer
    for token in [maybe, *end, *ids(tokenizer, "no")]:
        opened.advance(token)
    assert opened.is_complete
    answered.advance(ids(tokenizer, "yes")[0])  # no reasoning: held from the first token, the opening tag refused
    assert answered.phase == "grammar" and not answered.allows(start)


def test_the_engine_holds_the_answer_after_a_forced_reasoning(tokenizer: KilnTokenizer) -> None:
    """Teacher-forced reasoning tokens (which the grammar alone refuses) pass the gate, and the answer sampled after
    the closing tag is one of the choices."""
    llm = LLM("default", graph_mode="eager")
    thinking = ids(tokenizer, "Hmm, the sky is blue.</think>")
    gate = ReasoningGate(tuple(ids(tokenizer, "</think>")), inside=True)
    results = {}
    for name, constraint in (("gated", choice(gate)), ("held", choice(None))):
        params = SamplingParams(max_tokens=len(thinking) + 4, temperature=0.0, structured_output=constraint)
        llm.engine.add_request(name, "Is the sky blue? Answer yes or no.", params, forced_output=thinking)
        while llm.engine.has_unfinished:
            for out in llm.engine.step():
                if out.finished:
                    results[out.request_id] = out
    gated, held = results["gated"], results["held"]
    assert gated.error is None and gated.token_ids[: len(thinking)] == thinking
    assert tokenizer.decode(gated.token_ids[len(thinking) :]) in CHOICES
    assert held.finish_reason == "error" and "grammar" in (held.error or "")


def test_the_servers_gate_follows_the_parser(tokenizer: KilnTokenizer) -> None:
    r1, qwen3 = (reasoning_gate(REASONING_PARSERS[name], tokenizer) for name in ("deepseek_r1", "qwen3"))
    assert tokenizer.decode(list(r1.end)) == "</think>" and r1.inside and not qwen3.inside
    assert r1.start is None  # "<think>" is several tokens of the default model: no optional opening
