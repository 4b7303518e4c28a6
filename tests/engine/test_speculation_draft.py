"""Speculative decoding with a draft model (kiln.engine.speculation.draft): a second model in an engine of its own
proposes the drafts the target verifies. With the target itself as draft every proposal is accepted; with a differently
random draft few are, and the output is the same token for token in every graph mode; the draft engine's KV blocks are
all given back; the measured policy chooses before the draft runs, so drafts it would not verify are never computed;
a draft that fails costs only the speedup; and the settings are checked.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln import LLM, SamplingParams
from kiln.config import SpeculativeConfig
from kiln.engine.request import Request
from kiln.engine.speculation.speculation import MAX_PROBE_EVERY, PROBE_EVERY, Proposals, Speculator
from kiln.errors import ConfigError
from tests.engine.test_speculation import ALWAYS, BLOCK, GREEDY, PROMPTS, request, run
from tests.engine.tiny_models import write_hf_model


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The target (as the n-gram tests' tiny Llama), a draft with other random weights and the same vocabulary, one
    with a larger vocabulary and one with a shorter context."""
    root = tmp_path_factory.mktemp("tiny_draft")
    write_hf_model(root / "target", "llama", perturb=0.05)
    write_hf_model(root / "random", "llama", perturb=0.5)
    write_hf_model(root / "wide", "llama", vocab_size=320, perturb=0.05)
    write_hf_model(root / "short", "llama", perturb=0.05, max_position_embeddings=128)
    return {name: root / name for name in ("target", "random", "wide", "short")}


def draft_llm(target: Path, draft: Path | None, mode: str = "eager", **kwargs: object) -> LLM:
    graph = {} if mode == "eager" else dict(compiler="eager")
    spec = dict(speculative_method="draft", speculative_model=str(draft)) if draft else {}
    return LLM(str(target), block_size=BLOCK, num_kv_blocks=96, graph_mode=mode, **spec, **kwargs, **graph)


@pytest.mark.parametrize("mode", ["eager", "piecewise", "full_and_piecewise"])
def test_draft_model_outputs_equal_plain_decoding_and_the_target_as_its_own_draft_is_always_right(
    models: dict[str, Path], mode: str
) -> None:
    reference = run(draft_llm(models["target"], None, mode), PROMPTS, GREEDY)
    for draft in ("target", "random"):
        llm = draft_llm(models["target"], models[draft], mode, **ALWAYS)
        outs = [run(llm, [p], GREEDY)[0] for p in PROMPTS[:2]]  # batch 1, then mixed batches
        assert outs == reference[:2] and run(llm, PROMPTS, GREEDY) == reference, draft
        speculator = llm.engine.speculator
        stats, drafter = speculator.stats, speculator.drafter
        assert stats.num_draft_tokens > 0 and drafter.rounds > 0
        if draft == "target":  # the same model proposes exactly what the target picks
            assert stats.num_accepted_tokens == stats.num_draft_tokens
        else:
            assert stats.num_accepted_tokens <= 0.2 * stats.num_draft_tokens
        pool = drafter.engine.pool  # every draft block is free or cached once the rounds are over
        assert not drafter.engine.requests and all(pool.ref_count(b) == 0 for b in range(pool.num_blocks))
        if mode == "full_and_piecewise":  # the draft's own decode steps replay its full decode graphs
            assert drafter.engine.executor.counters.full_replays > 0
            assert llm.engine.executor.counters.full_verify_replays > 0


def test_sampled_drafts_carry_their_distribution_so_the_target_as_draft_accepts_them_all(
    models: dict[str, Path],
) -> None:
    """A sampled request's draft samples as it does and hands its distribution q to the verification: with the
    target itself as draft p == q, so every draft is accepted (greedy-drafted, it would accept a draft only with the
    probability p of the draft model's argmax); a seeded request repeats."""
    llm = draft_llm(models["target"], models["target"], **ALWAYS)
    params = SamplingParams(max_tokens=16, temperature=0.8, top_k=50, seed=3, ignore_eos=True, logprobs=1)
    first, again = (llm.generate([PROMPTS[0]], params)[0] for _ in range(2))
    assert first.token_ids == again.token_ids and len(first.token_ids) == 16
    stats = llm.engine.speculator.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens
    other = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=16, temperature=0.8, top_k=50, seed=4))[0]
    assert other.token_ids != first.token_ids  # the seed, not the draft, decides the tokens


class RecordingDrafter:
    def __init__(self, per_token: float | None = 0.0) -> None:
        self.calls: list[list[tuple[str, int]]] = []
        self.per_token = per_token  # a round's seconds per sequence and draft depth (None: not measured)

    def round_seconds(self, sequences: int, depth: int) -> float | None:
        return None if self.per_token is None else self.per_token * sequences * depth

    def propose(self, wanted: list[tuple[Request, int]]) -> Proposals:
        self.calls.append([(req.request_id, count) for req, count in wanted])
        return Proposals({req.request_id: [9] * count for req, count in wanted})


def test_the_measured_policy_chooses_before_the_draft_model_runs() -> None:
    drafter = RecordingDrafter()
    config = SpeculativeConfig("draft", num_speculative_tokens=3, draft_model="d")
    spec = Speculator(config, max_model_len=99, drafter=drafter)
    reqs = [request(str(i), [1, 2, 3] * 4) for i in range(2)]
    assert spec.propose(reqs).tokens == {} and drafter.calls == []  # the plain step is measured first: no round
    for req in reqs:
        spec.states[req.request_id].held = [0.9, 0.8, 0.1]
    spec.costs.seconds = {r: 0.005 * r for r in range(2, 9)}  # compute-bound: no draft pays
    assert spec.propose(reqs).tokens == {} and drafter.calls == []
    spec.costs.seconds = {r: 0.010 + 0.0005 * (r - 2) for r in range(2, 9)}  # cheap rows: the likely drafts pay
    assert spec.propose(reqs).tokens == {"0": [9, 9], "1": [9, 9]}
    assert drafter.calls == [[("0", 2), ("1", 2)]]  # only the drafts chosen are asked of the draft model
    limited = request("2", [1, 2, 3] * 4, output=[5, 6], max_tokens=4)
    always = Speculator(SpeculativeConfig("draft", 3, policy="always", draft_model="d"), 99, drafter)
    always.propose([limited, reqs[0]])
    assert drafter.calls[-1] == [("2", 1), ("0", 3)]  # within max_tokens: 4 - 2 outputs - its own next token
    with pytest.raises(ValueError, match="needs"):  # the draft model is built before its speculator
        Speculator(config, 99)
    drafter.per_token = 0.005  # a draft as costly as a sequence of the target: its rounds cost more than they bring
    assert spec.propose(reqs).tokens == {}
    drafter.per_token = 0.0005
    assert spec.propose(reqs).tokens == {"0": [9, 9], "1": [9, 9]}  # a cheap one: the rounds pay
    drafter.per_token = None  # a round not measured yet is tried, one row at a time
    assert spec.propose(reqs).tokens == {"0": [9]}


def test_probes_of_a_draft_that_does_not_pay_back_off() -> None:
    """Every PROBE_EVERY-th choice runs the other way; while drafting keeps losing, its probes (each a whole draft
    round) come half as often each time, up to MAX_PROBE_EVERY; once drafting pays, the plain probes are back to
    PROBE_EVERY."""
    drafter = RecordingDrafter(per_token=0.05)  # far costlier than the target's step
    spec = Speculator(SpeculativeConfig("draft", 2, draft_model="d"), max_model_len=999, drafter=drafter)
    req = request("0", [1, 2, 3] * 4, max_tokens=900)
    spec.costs.seconds = {r: 0.010 for r in range(1, 4)}
    probes = [i for i in range(1, 1200) if spec.propose([req]).tokens]
    gaps = [b - a for a, b in zip([0, *probes], probes, strict=False)]
    assert gaps[:5] == [PROBE_EVERY, 2 * PROBE_EVERY, 4 * PROBE_EVERY, 8 * PROBE_EVERY, MAX_PROBE_EVERY]
    assert set(gaps[5:]) == {MAX_PROBE_EVERY} and len(drafter.calls) == len(probes)
    drafter.per_token = 0.0  # drafting pays now: the plain step is the probe, every PROBE_EVERY-th choice
    plain = [i for i in range(1, 3 * PROBE_EVERY + 1) if not spec.propose([req]).tokens]
    assert len(plain) <= 3 and spec.probe_every == PROBE_EVERY


def test_a_failing_draft_round_costs_only_the_speedup(
    models: dict[str, Path], kiln_log: pytest.LogCaptureFixture
) -> None:
    reference = run(draft_llm(models["target"], None), PROMPTS[:2], GREEDY)
    llm = draft_llm(models["target"], models["target"], **ALWAYS)
    draft_engine = llm.engine.speculator.drafter.engine
    steps = {"n": 0}
    real_step = draft_engine.step

    def flaky_step() -> list:
        steps["n"] += 1
        if steps["n"] % 3 == 0:
            raise RuntimeError("draft kernel fault")
        return real_step()

    draft_engine.step = flaky_step
    assert run(llm, PROMPTS[:2], GREEDY) == reference
    assert "draft model round failed" in kiln_log.text and not draft_engine.requests
    assert llm.engine.speculator.stats.num_accepted_tokens > 0  # the rounds that ran still helped


def test_draft_settings_are_checked(models: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match="the draft method needs a draft model"):
        LLM(speculative_method="draft")
    with pytest.raises(ConfigError, match="only used by the draft method, not by ngram"):
        LLM(speculative_method="ngram", speculative_model="default")
    with pytest.raises(ConfigError, match=r"vocabulary of 320 tokens but the model .* has 256"):
        draft_llm(models["target"], models["wide"])
    with pytest.raises(ConfigError, match="holds 128 positions, fewer than max_model_len 512"):
        draft_llm(models["target"], models["short"])
