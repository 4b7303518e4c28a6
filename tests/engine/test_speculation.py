"""Speculative decoding (n-gram proposals verified in one target step): the proposer and its back-off, the
verification rules (greedy: the target's own tokens; sampled: exactly the target's distribution, by a chi-square
test), and end to end on a tiny random Llama in every graph mode: greedy tokens identical with speculation on and off
at batch 1 and in mixed batches, under chunked prefill, preemption and prefix caching, with the KV blocks of
rejected drafts given back after every step and none held at the end.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.config import SpeculativeConfig
from kiln.engine.core import EngineCore
from kiln.engine.request import Request
from kiln.engine.sampling.sampler import SamplingRow
from kiln.engine.sampling.spec_verify import verify
from kiln.engine.speculation.speculation import COST_EMA, MAX_BACKOFF, PROBE_EVERY, NgramIndex, Speculator
from kiln.errors import ConfigError
from tests.engine.tiny_models import write_hf_model

BLOCK = 4
# a passage the prompt repeats, so the model's continuation has earlier occurrences to look up
PASSAGE = [(5 * i) % 97 + 3 for i in range(12)]
PROMPTS = [PASSAGE * 3, [7, 8, 9] + PASSAGE * 2, [40 + i for i in range(9)], PASSAGE[:5] * 4]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
ALWAYS = dict(speculative_policy="always")  # every proposal verified (the measured policy has a test of its own)


def speculating(method: str | None) -> dict[str, str | None]:
    """The engine options of `method` verifying every proposal (no method: speculation off, no policy)."""
    return dict(speculative_method=method, **ALWAYS) if method else {}


CHI2_5_DOF_999 = 20.515  # the chi-square distribution's 99.9th percentile with 5 degrees of freedom


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_llama_spec")
    write_hf_model(path, "llama", perturb=0.05)
    return path


def request(rid: str, prompt: list[int], output: list[int] = (), max_tokens: int = 32) -> Request:
    req = Request(rid, None, prompt, SamplingParams(max_tokens=max_tokens, temperature=0), None)
    req.output_token_ids = list(output)
    return req


# -- the proposer --------------------------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix() -> None:
    index = NgramIndex(1, 3)
    index.extend([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    assert index.propose(3) == [7, 8, 5]  # "2 3" last occurred before "7 8 5" (not the older "2 3 9")
    index.extend([7])
    assert index.propose(2) == [8, 5]  # "2 3 7" is the longest match now
    index.extend([4])
    assert index.propose(4) == []  # 4 never occurred before
    only_long = NgramIndex(3, 3)
    only_long.extend([1, 2, 6, 1, 2])
    assert only_long.propose(4) == []  # "1 2" occurs, but no 3-gram does
    index = NgramIndex(2, 2)
    index.extend([4, 4, 4])
    assert index.propose(5) == [4]  # the suffix itself is not an earlier occurrence: only the one before it


def test_speculator_limits_and_back_off() -> None:
    spec = Speculator(SpeculativeConfig("ngram", num_speculative_tokens=4, prompt_lookup_min=1), max_model_len=30)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8] * 3
    assert spec.ngram_drafts(request("a", prompt), budget=8) == [1, 2, 3, 4]
    assert spec.ngram_drafts(request("b", prompt), budget=2) == [1, 2]
    assert spec.ngram_drafts(request("c", prompt, [1, 2], max_tokens=4), budget=8) == [3]  # 4 - 2 outputs - its own
    assert spec.ngram_drafts(request("d", prompt, [1, 2, 3, 4, 5], max_tokens=99), budget=8) == []  # 29 of 30 tokens
    forced = request("e", prompt, [5])
    forced.forced_output = [5, 9, 8, 7, 6, 5]  # a teacher-forced request (the debugger's) proposes nothing: it
    assert (
        spec.ngram_drafts(forced, budget=8) == []
    )  # verifies its next given tokens, as many as fit, whatever the policy
    assert spec.propose([forced]).tokens == {"e": [9, 8, 7, 6]}
    req = request("r", prompt)
    waits = []
    for _ in range(8):  # every verification rejects everything: proposals every 1, 2, 4 ... steps
        drafts = spec.ngram_drafts(req, budget=8)
        if drafts:
            spec.verified(req, len(drafts), 0)
        waits.append(bool(drafts))
    assert waits == [True, False, True, False, False, True, False, False]
    state = spec.states["r"]
    state.failures = 50
    spec.verified(req, 4, 0)
    assert state.wait == MAX_BACKOFF
    spec.verified(req, 4, 1)
    assert state.wait == 0 and state.failures == 0
    assert spec.stats.num_accepted_tokens == 1 and spec.stats.accepted_per_position == [1, 0, 0, 0]
    assert spec.stats.drafted_per_position == [spec.stats.num_drafts] * 4  # every verification had 4 drafts
    assert state.held[0] == pytest.approx(COST_EMA) and state.held[1] == 0.0  # one in the last: held at 0, not 1


def test_the_measured_policy_verifies_the_drafts_that_raise_tokens_per_second() -> None:
    spec = Speculator(SpeculativeConfig("ngram", num_speculative_tokens=4, prompt_lookup_min=1), max_model_len=99)
    reqs = [request(str(i), [1, 2, 3, 4, 5, 6, 7, 8] * 3) for i in range(2)]
    assert spec.propose(reqs).tokens == {}  # the plain step of two sequences is measured first
    for req in reqs:  # 9 of 10 verifications accept the first draft, 81 % the first two, ...
        spec.states[req.request_id].held = [0.9 ** (j + 1) for j in range(4)]
    spec.costs.seconds = {2: 0.010, 3: 0.0105}
    assert spec.propose(reqs).tokens == {"0": [1], "1": [1]}  # one row count past those measured is tried
    spec.costs.seconds = {r: 0.005 * r for r in range(2, 11)}  # compute-bound: a row costs a sequence's time
    assert spec.propose(reqs).tokens == {}  # 0.9 of a token for a sequence's cost does not pay
    spec.costs.seconds = {r: 0.010 + 0.0005 * (r - 2) for r in range(2, 11)}  # bound by the weights: rows are cheap
    assert spec.propose(reqs).tokens == {"0": [1, 2, 3, 4], "1": [1, 2, 3, 4]}
    spec.states["1"].held = [
        0.1,
        0.01,
        0.001,
        0.0001,
    ]  # drafts that rarely hold: 0.1 of a token for a row does not pay even so
    assert spec.propose(reqs).tokens == {"0": [1, 2, 3, 4]}
    spec.costs.seconds = {2: 0.010, 3: 0.011, 4: 0.020, 5: 0.021, 6: 0.030, 7: 0.031, 8: 0.04, 9: 0.041, 10: 0.05}
    assert spec.propose(reqs).tokens == {"0": [1]}  # cheap up to 3 rows, then each pair costs a step: one draft
    while spec.num_choices % PROBE_EVERY != PROBE_EVERY - 1:
        spec.propose(reqs)
    assert spec.propose(reqs).tokens == {}  # every PROBE_EVERY-th choice runs the other way, measuring plain steps
    spec.costs.observe(2, 0.020)
    assert spec.costs.seconds[2] == pytest.approx(0.010 + COST_EMA * 0.010)


# -- verification --------------------------------------------------------------------------------------------
def rows_for(params: SamplingParams, n: int, generator: torch.Generator | None = None) -> list[SamplingRow]:
    return [SamplingRow(params, [1], [], generator, []) for _ in range(n)]


def test_greedy_verification_accepts_the_matching_prefix_then_the_target_token() -> None:
    logits = torch.full((4, 8), -5.0)
    for row, best in enumerate([3, 5, 6, 1]):
        logits[row, best] = 5.0
    params = SamplingParams(temperature=0)
    assert verify(logits, rows_for(params, 4), [3, 5, 2]).token_ids == [3, 5, 6]
    assert verify(logits, rows_for(params, 4), [3, 5, 6]).token_ids == [3, 5, 6, 1]  # all accepted + bonus
    assert verify(logits, rows_for(params, 4), [4, 5, 6]).token_ids == [3]
    bad = logits.clone()
    bad[1, 0] = float("nan")
    assert "non-finite" in verify(bad, rows_for(params, 4), [3, 5, 6]).error


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("draft", ["one-hot", "distribution"])
def test_rejection_sampling_keeps_the_target_distribution(draft: str) -> None:
    """The first token a verification emits follows the target's distribution p, whatever the draft proposes (a
    likely token, an unlikely one, or one drawn from a draft distribution q); after an accepted first draft, the
    second token follows the target's next row."""
    p = torch.tensor([[0.05, 0.4, 0.1, 0.25, 0.15, 0.05], [0.3, 0.1, 0.2, 0.1, 0.2, 0.1]])
    q = torch.tensor([[0.5, 0.1, 0.1, 0.1, 0.1, 0.1]])
    logits = torch.cat([p.log(), p[1:].log()])
    params = SamplingParams(temperature=1.0, seed=0)
    gen = torch.Generator().manual_seed(1234)
    draw_gen = torch.Generator().manual_seed(99)
    first, second = torch.zeros(6), torch.zeros(6)
    for i in range(12000):
        if draft == "distribution":
            drafts = torch.multinomial(q[0], 2, replacement=True, generator=draw_gen).tolist()
        else:
            drafts = [i % 2, 2]  # a likely and an unlikely first draft
        v = verify(logits, rows_for(params, 3, gen), drafts, q.expand(2, 6) if draft == "distribution" else None)
        first[v.token_ids[0]] += 1
        if len(v.token_ids) > 1:  # the first draft was accepted: the second token is the target's next row's
            second[v.token_ids[1]] += 1
    assert chi_square(first, p[0]) < CHI2_5_DOF_999
    assert second.sum() > 2000 and chi_square(second, p[1]) < CHI2_5_DOF_999


# -- end to end ----------------------------------------------------------------------------------------------
def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK)


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Step the engine to the end, checking after every step that no running request holds a block past its
    tokens (a rejected draft's block went back) and, at the end, that every block is free or cached."""
    engine: EngineCore = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        for req in engine.scheduler.running:
            assert len(req.block_ids) <= blocks_for(req.num_tokens), req.request_id
    pool = engine.pool
    assert pool.num_free_blocks == pool.num_blocks and all(pool.ref_count(b) == 0 for b in range(pool.num_blocks))
    return [done[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("mode", ["eager", "piecewise", "full_and_piecewise"])
def test_greedy_tokens_are_the_same_with_speculation_in_every_mode(tiny: Path, mode: str) -> None:
    graph = {} if mode == "eager" else dict(compiler="eager")
    outs, engines = {}, {}
    for spec in (None, "ngram"):
        llm = LLM(str(tiny), block_size=BLOCK, num_kv_blocks=96, graph_mode=mode, **speculating(spec), **graph)
        outs[spec] = [run(llm, [p], GREEDY)[0] for p in PROMPTS[:2]]  # batch 1
        outs[spec] += run(llm, PROMPTS, GREEDY)  # mixed batches: prefills beside verifications
        engines[spec] = llm.engine
    assert outs["ngram"] == outs[None]
    stats = engines["ngram"].speculator.stats
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    if mode != "eager":
        counters = engines["ngram"].executor.counters
        assert counters.verify_steps > 0 and engines[None].executor.counters.verify_steps == 0
        if mode == "full_and_piecewise":  # verification steps of decodes alone replay the full decode graph
            assert 0 < counters.full_verify_replays <= counters.verify_steps


def test_speculation_under_chunked_prefill_preemption_and_prefix_caching(tiny: Path) -> None:
    small = dict(block_size=BLOCK, num_kv_blocks=28, max_num_seqs=4, max_num_batched_tokens=12, graph_mode="eager")
    outs, engines = {}, {}
    for spec in (None, "ngram"):
        llm = LLM(str(tiny), **speculating(spec), **small)
        outs[spec] = run(llm, PROMPTS, GREEDY)
        outs[spec] += run(llm, PROMPTS[:2], GREEDY)  # their prompts' blocks are cached now
        engines[spec] = llm.engine
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.scheduler.prefix.stats.hits > 0
    assert outs["ngram"] == outs[None]
    assert engines["ngram"].speculator.stats.num_accepted_tokens > 0


def test_aborts_and_stops_inside_accepted_drafts_leave_nothing_held(tiny: Path) -> None:
    llm = LLM(str(tiny), block_size=BLOCK, num_kv_blocks=64, graph_mode="eager", speculative_method="ngram", **ALWAYS)
    engine = llm.engine
    reference = run(llm, [PROMPTS[0]], GREEDY)[0]
    stop_at = reference[5]
    stopped = run(llm, [PROMPTS[0]], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_at]))[0]
    assert stopped == reference[: reference.index(stop_at) + 1]  # nothing after the stop token, even if accepted
    assert run(llm, [PROMPTS[0]], SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))[0] == reference[:7]
    engine.add_request("a", PROMPTS[0], GREEDY)
    while not engine.speculator.stats.num_drafts or not engine.scheduler.running:
        engine.step()
    engine.step()
    engine.abort("a")
    assert engine.pool.num_free_blocks == engine.pool.num_blocks and not engine.speculator.states


def test_seeded_sampled_requests_repeat_with_speculation(tiny: Path) -> None:
    llm = LLM(str(tiny), block_size=BLOCK, num_kv_blocks=64, graph_mode="eager", speculative_method="ngram", **ALWAYS)
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True, logprobs=1)
    first, again = (llm.generate([PROMPTS[0]], params)[0] for _ in range(2))
    assert first.token_ids == again.token_ids and len(first.token_ids) == 16
    assert len(first.logprobs) == 16 and all(t in lp for t, lp in zip(first.token_ids, first.logprobs, strict=True))


def test_speculative_flags_are_checked() -> None:
    with pytest.raises(ConfigError, match="prompt-lookup-min 5 is above --prompt-lookup-max 3"):
        LLM(speculative_method="ngram", prompt_lookup_min=5, prompt_lookup_max=3)
    with pytest.raises(ConfigError, match="one device"):
        LLM(speculative_method="ngram", tensor_parallel_size=2)


def test_default_model_repeating_a_passage_accepts_most_drafts_with_the_same_tokens() -> None:
    """The default model (float32 weights), full_and_piecewise: asked to repeat a passage, most n-gram drafts are
    accepted (verifications replay the full decode graph), and the greedy tokens are those without speculation, for
    the passage alone and beside a free-generation prompt."""
    passage = (
        "The lighthouse stands on a rock half a mile from the shore and can only be reached at low tide. It was "
        "built from granite blocks cut on the mainland, each one numbered and shaped to lock into its neighbours."
    )
    outs, engines = {}, {}
    for spec in (None, "ngram"):
        llm = LLM("default", quantization="none", num_kv_blocks=64, **speculating(spec))
        chat = llm.tokenizer.encode_chat
        prompts = [chat([{"role": "user", "content": f"Repeat this text exactly:\n\n{passage}"}])]
        prompts.append(chat([{"role": "user", "content": "Write a poem about the sea."}]))
        params = SamplingParams(max_tokens=40, temperature=0)
        outs[spec] = [o.token_ids for o in llm.generate(prompts[:1], params) + llm.generate(prompts, params)]
        engines[spec] = llm.engine
    assert outs["ngram"] == outs[None]
    stats, counters = engines["ngram"].speculator.stats, engines["ngram"].executor.counters
    assert stats.num_accepted_tokens >= 0.6 * stats.num_draft_tokens > 0
    assert counters.full_verify_replays > 0
