"""A seed reproduces sampling with speculative decoding (issue 51): each output position draws from its own
generator, so a step that verifies n-gram drafts emits the tokens plain decoding draws, whatever was verified when
(with the measured policy that depends on timing). Before, the same seeded request gave 2-3 texts in 3 runs: a
verifying step took its acceptance uniforms from the one stream plain decoding takes its tokens' from."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.engine.request import Request, position_seed
from kiln.engine.sampling.sampler import SamplingRow, draw
from kiln.engine.sampling.spec_verify import verify

# a text that repeats, so the n-gram proposer finds drafts in the prompt and the output
ASK = "Count with me: one two three four five, one two three four five, one two three four five, one two"


def test_each_position_has_its_own_stream() -> None:
    req = Request("r", None, [1, 2], SamplingParams(temperature=1.0, seed=7), torch.Generator().manual_seed(7))
    first = [float(torch.rand(1, generator=req.generator_at(p))) for p in range(4)]
    again = [float(torch.rand(1, generator=req.generator_at(p))) for p in (3, 2, 1, 0)][::-1]
    assert first == again and len(set(first)) == 4
    assert position_seed(7, 0) != position_seed(8, 0) and position_seed(7, 1) != position_seed(7, 0)
    assert Request("g", None, [1], SamplingParams(temperature=0), None).generator_at(0) is None


def test_verifying_n_gram_drafts_emits_what_plain_decoding_draws() -> None:
    vocab, params = 50, SamplingParams(temperature=1.0)
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(1))
    req = Request("r", None, [1], params, torch.Generator().manual_seed(3))

    def row(position: int) -> SamplingRow:
        return SamplingRow(params, [1], [0] * position, req.generator_at(position), [])

    plain = [int(draw(logits[p : p + 1].softmax(-1), [row(p).generator])[0]) for p in range(4)]
    for num_right in range(4):  # drafts right up to num_right, then wrong
        drafts = [*plain[:num_right], (plain[num_right] + 1) % vocab] if num_right < 3 else plain[:3]
        verified = verify(logits[: len(drafts) + 1], [row(p) for p in range(len(drafts) + 1)], drafts)
        assert verified.token_ids == plain[: len(verified.token_ids)]
        assert verified.num_accepted == min(num_right, len(drafts))


@pytest.fixture(scope="module")
def speculating() -> LLM:
    return LLM(
        "default",
        dtype="float32",
        seed=0,
        quantization="none",
        graph_mode="eager",
        speculative_method="ngram",
        speculative_policy="always",
    )


def test_a_seeded_request_gives_the_same_text_with_and_without_speculation(llm: LLM, speculating: LLM) -> None:
    params = [SamplingParams(max_tokens=32, temperature=1.0, seed=seed, ignore_eos=True) for seed in (11, 12)]
    plain = [out.token_ids for out in llm.generate([ASK, ASK], params)]
    stats = speculating.engine.speculator.stats
    drafts_before = stats.num_drafts
    held = [out.token_ids for out in speculating.generate([ASK, ASK], params)]
    alone = speculating.generate(ASK, params[0])[0].token_ids  # another batch, other steps verified
    assert stats.num_drafts > drafts_before, "no draft was verified: the test shows nothing"
    assert held == plain and alone == plain[0] and plain[0] != plain[1]
