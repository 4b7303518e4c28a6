"""Embeddings (SamplingParams.embed, LLM.embed) equal HF transformers' final hidden states (`model.model(ids)
.last_hidden_state`, after the final norm) pooled the same way, to 1e-4 with float32 weights, activations and KV
cache: last token, mean and first token (cls), normalized and not, in eager, piecewise and full_and_piecewise, in
one prefill step for a batch of prompts of different lengths and in small chunks; a cached prefix is not read; an
embedding samples nothing and frees its blocks; a preempted one pools its prompt anew."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.engine.setup.args import EngineArgs
from kiln.errors import RequestError
from tests.engine.tiny_models import write_hf_model

BLOCK = 4
PREFIX = [(7 * i) % 200 + 3 for i in range(21)]  # 5 full blocks and one token
PROMPTS = [[*PREFIX, 11, 12, 13], PREFIX[:9], [5, 6], [42]]
FP32 = dict(dtype="float32", activations="float32", kv_cache_dtype="float32", block_size=BLOCK, num_kv_blocks=64)
POOL = {"last": lambda h: h[-1], "mean": lambda h: h.mean(dim=0), "cls": lambda h: h[0]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("tiny_llama_embeddings")
    return path, write_hf_model(path, "llama", perturb=0.05)


def hf_embedding(hf: torch.nn.Module, prompt: list[int], pooling: str, normalize: bool = True) -> torch.Tensor:
    """HF's final hidden states (after the model's final norm) pooled as kiln pools them."""
    with torch.no_grad():
        hidden = hf.model(torch.tensor([prompt])).last_hidden_state[0].float()
    vector = POOL[pooling](hidden)
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def assert_hf_embedding(hf: torch.nn.Module, prompt: list[int], got: list[float], pooling: str, normalize=True):
    expected = hf_embedding(hf, prompt, pooling, normalize)
    assert len(got) == expected.numel()
    assert torch.allclose(torch.tensor(got), expected, atol=1e-4, rtol=0), (prompt, pooling)


def graph_options(mode: str) -> dict:
    return {} if mode == "eager" else dict(compiler="eager", capture_sizes=(1, 2, 4))


def test_hf_last_hidden_state_includes_the_final_norm(tiny) -> None:
    """What kiln pools is HF's `last_hidden_state`, which is the final norm's output (the logits' input)."""
    _, hf = tiny
    with torch.no_grad():
        out = hf(torch.tensor([PREFIX]), output_hidden_states=True)
        last = hf.model(torch.tensor([PREFIX])).last_hidden_state
    assert torch.allclose(out.hidden_states[-1], last)
    assert torch.allclose(hf.lm_head(last), out.logits, atol=1e-5)


@pytest.mark.parametrize("mode", ["eager", "piecewise", "full_and_piecewise"])
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_embeddings_match_hf_in_every_mode(tiny, mode: str, chunked: bool, pooling: str) -> None:
    """A batch of prompts of different lengths (one prefill step, or 4-token chunks), then a prompt whose prefix
    another request cached (the embedding reads none of it): every vector is HF's pooled the same way."""
    path, hf = tiny
    chunks = dict(max_num_batched_tokens=4, enable_chunked_prefill=True) if chunked else {}
    options = dict(graph_mode=mode, enable_prefix_caching=True, pooling=pooling, **FP32, **chunks)
    llm = LLM(str(path), **options, **graph_options(mode))
    steps = llm.engine.num_steps
    outs = llm.embed(PROMPTS)
    if not chunked:
        assert llm.engine.num_steps == steps + 1  # the whole batch in one step
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.prompt_token_ids == prompt
        assert_hf_embedding(hf, prompt, out.outputs.embedding, pooling)
    cached_prompt = [*PREFIX, 31, 32]
    plain = llm.generate([cached_prompt], SamplingParams(max_tokens=1, temperature=0))[0]
    assert plain.num_cached_tokens == 5 * BLOCK
    (again,) = llm.generate([cached_prompt], SamplingParams(embed=True))
    assert again.num_cached_tokens == 0 and again.token_ids == [] and again.finish_reason == "stop"
    assert_hf_embedding(hf, cached_prompt, again.embedding, pooling)
    assert llm.engine.pool.num_used_blocks == 0  # every request finished: none holds a block
    if mode == "full_and_piecewise":  # one-token prompts alone are a step of decode rows: the full graph's
        replays = llm.engine.executor.counters.full_replays
        singles = llm.embed([[42], [7]])
        assert llm.engine.executor.counters.full_replays == replays + 1
        for prompt, out in zip([[42], [7]], singles, strict=True):
            assert_hf_embedding(hf, prompt, out.outputs.embedding, pooling)


def test_embeddings_beside_generation_in_one_step_and_unnormalized(tiny) -> None:
    """Embedding requests share steps with requests that sample, which still sample; --no-normalize-embeddings
    keeps HF's raw pooled vector."""
    path, hf = tiny
    llm = LLM(str(path), graph_mode="eager", pooling="mean", normalize_embeddings=False, **FP32)
    greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    alone = llm.generate([PREFIX], greedy)[0]
    mixed = llm.generate([PREFIX, PROMPTS[0], PROMPTS[2]], [greedy, SamplingParams(embed=True), greedy])
    assert mixed[0].token_ids == alone.token_ids and mixed[0].embedding is None
    assert len(mixed[2].token_ids) == 3
    assert mixed[1].token_ids == [] and mixed[1].embedding is not None
    assert_hf_embedding(hf, PROMPTS[0], mixed[1].embedding, "mean", normalize=False)
    assert abs(torch.tensor(mixed[1].embedding).norm().item() - 1.0) > 1e-2


def test_preempted_embeddings_pool_their_prompt_anew(tiny) -> None:
    """Six long prompts, every other one an embedding, in 8-token chunks in a pool too small for all: embeddings are
    preempted mid-prompt and recomputed, and every mean still counts each position once."""
    path, hf = tiny
    prompts = [PREFIX + [40 + i] * (i + 1) for i in range(6)]
    small = dict(num_kv_blocks=12, max_num_seqs=6, max_num_batched_tokens=8, enable_chunked_prefill=True)
    llm = LLM(str(path), graph_mode="eager", pooling="mean", enable_prefix_caching=False, **{**FP32, **small})
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, [greedy if i % 2 == 0 else SamplingParams(embed=True) for i in range(6)])
    embedded = outs[1::2]
    assert any(out.metrics.num_preemptions > 0 for out in embedded)
    for prompt, out in zip(prompts[1::2], embedded, strict=True):
        assert_hf_embedding(hf, prompt, out.embedding, "mean")
    assert all(len(out.token_ids) == 16 for out in outs[::2])


def test_an_embedding_as_long_as_the_context_is_served_and_a_longer_one_refused(tiny) -> None:
    path, hf = tiny
    llm = LLM(str(path), graph_mode="eager", max_model_len=24, **FP32)
    (out,) = llm.embed([[*PREFIX, 1, 2, 3]])  # 24 tokens: no room is kept for an output
    assert_hf_embedding(hf, [*PREFIX, 1, 2, 3], out.outputs.embedding, "last")
    with pytest.raises(RequestError, match="max_model_len=24") as exc:
        llm.embed([[*PREFIX, 1, 2, 3, 4]])
    assert exc.value.param == "prompt"


def test_an_embedding_takes_no_sampling_outputs() -> None:
    for field in ({"logprobs": 1}, {"prompt_logprobs": 0}):
        with pytest.raises(RequestError, match="samples nothing") as exc:
            SamplingParams(embed=True, **field)
        assert exc.value.param == "embed"


def test_pooling_flags_reach_the_config_and_a_bad_mode_is_refused() -> None:
    config = EngineArgs(pooling="cls", normalize_embeddings=False).create_engine_config()
    assert (config.pooling.mode, config.pooling.normalize) == ("cls", False)
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--pooling", "mean", "--no-normalize-embeddings"])
    assert (args.pooling, args.normalize_embeddings) == ("mean", False)
    with pytest.raises(SystemExit):
        parser.parse_args(["--pooling", "max"])


def test_an_embedding_verifies_no_drafts_under_speculative_decoding(tiny) -> None:
    """With n-gram speculation on, an embedding's last prompt chunk (one token, after a chunk of 8) is not offered
    drafts as a decoding sequence's would be: its rows are its prompt's alone."""
    path, hf = tiny
    prompt = [5, 6, 7, 8] * 2 + [5]  # the last token's n-gram recurs, so a proposer would offer drafts
    spec = dict(speculative_method="ngram", speculative_policy="always", num_speculative_tokens=2)
    chunks = dict(max_num_batched_tokens=8, enable_chunked_prefill=True, long_prefill_token_threshold=8)
    llm = LLM(str(path), graph_mode="eager", pooling="mean", enable_prefix_caching=False, **FP32, **spec, **chunks)
    planned = []
    plan = llm.engine.runner.plan
    llm.engine.runner.plan = lambda sched: planned.append(p := plan(sched)) or p  # type: ignore[method-assign]
    (out,) = llm.embed([prompt])
    assert len(planned) == 2 and all(p.num_draft_tokens == 0 for p in planned)
    assert_hf_embedding(hf, prompt, out.outputs.embedding, "mean")
    llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert any(p.num_draft_tokens for p in planned[2:])  # the same prompt generating verifies drafts
