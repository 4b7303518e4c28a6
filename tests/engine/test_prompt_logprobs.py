"""Prompt logprobs (SamplingParams.prompt_logprobs) equal HF transformers' log-softmax over the same prompt, to 1e-4
with float32 weights, activations and KV cache: in eager, piecewise and full_and_piecewise modes, in one prefill and
in small chunks, and after the prompt's prefix was cached by another request (which must not be read: every row is
scored from the request's own forward). Each position's actual token comes with its rank, and the top entries are
HF's likeliest tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.engine.request import Logprob
from tests.engine.hf_ranks import assert_rank_as_hf
from tests.engine.tiny_models import write_hf_model

BLOCK = 4
PREFIX = [(7 * i) % 200 + 3 for i in range(21)]  # 5 full blocks and one token
PROMPTS = [[*PREFIX, 11, 12, 13], PREFIX[:9], [5, 6]]
TOP = 3
FP32 = dict(dtype="float32", activations="float32", kv_cache_dtype="float32", block_size=BLOCK, num_kv_blocks=64)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("tiny_llama_prompt_logprobs")
    return path, write_hf_model(path, "llama", perturb=0.05)


def hf_logprobs(hf: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """HF's log-softmax after each prompt token: row q is the distribution of token q + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)


def assert_hf_prompt_logprobs(hf: torch.nn.Module, prompt: list[int], got: list[dict[int, Logprob] | None]) -> None:
    expected = hf_logprobs(hf, prompt)
    assert len(got) == len(prompt) and got[0] is None
    for q in range(1, len(prompt)):
        entry, row = got[q], expected[q - 1]
        assert entry is not None
        token = prompt[q]
        assert next(iter(entry)) == token  # the actual token first
        assert abs(entry[token].logprob - row[token].item()) < 1e-4, (prompt, q)
        assert_rank_as_hf(entry[token].rank, row, token)
        top = row.topk(TOP)
        ranked = sorted((lp.rank, t) for t, lp in entry.items() if t != token or lp.rank <= TOP)
        assert [t for _, t in ranked][:TOP] == top.indices.tolist()
        for t, lp in entry.items():
            assert abs(lp.logprob - row[t].item()) < 1e-4


def graph_options(mode: str) -> dict:
    return {} if mode == "eager" else dict(compiler="eager", capture_sizes=(1, 2, 4))


def asking(max_tokens: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, prompt_logprobs=TOP)


@pytest.mark.parametrize("mode", ["eager", "piecewise", "full_and_piecewise"])
@pytest.mark.parametrize("chunked", [False, True])
def test_prompt_logprobs_match_hf_in_every_mode(tiny, mode: str, chunked: bool) -> None:
    """A batch of prompts (one prefill step, or 4-token chunks), a 2-token prompt alone (a captured piecewise step,
    then decodes through the full graph), then a prompt whose prefix another request cached: every position's
    logprobs are HF's, and the cached prefix is not read (nothing counted cached)."""
    path, hf = tiny
    chunks = dict(max_num_batched_tokens=4, enable_chunked_prefill=True) if chunked else {}
    llm = LLM(str(path), graph_mode=mode, enable_prefix_caching=True, **FP32, **chunks, **graph_options(mode))
    outs = llm.generate(PROMPTS, asking(max_tokens=3)) + llm.generate([[5, 6]], asking(max_tokens=3))
    for prompt, out in zip([*PROMPTS, [5, 6]], outs, strict=True):
        assert out.finish_reason == "length" and len(out.token_ids) == 3
        assert_hf_prompt_logprobs(hf, prompt, out.prompt_logprobs)
    cached_prompt = [*PREFIX, 31, 32]
    plain = llm.generate([cached_prompt], SamplingParams(max_tokens=1, temperature=0))[0]
    assert plain.num_cached_tokens == 5 * BLOCK  # the first request filled the cache with the prefix's blocks
    again = llm.generate([cached_prompt], asking())[0]
    assert again.num_cached_tokens == 0
    assert_hf_prompt_logprobs(hf, cached_prompt, again.prompt_logprobs)
    if mode != "eager":
        assert llm.engine.executor.counters.piece_replays > 0  # prompt rows read from captured pieces
    if mode == "full_and_piecewise":
        assert llm.engine.executor.counters.full_replays > 0


def test_requests_without_prompt_logprobs_get_none_and_one_token_prompts_get_only_none(tiny) -> None:
    path, _ = tiny
    llm = LLM(str(path), graph_mode="eager", **FP32)
    plain, single = llm.generate([PREFIX, [7]], [SamplingParams(max_tokens=1), asking()])
    assert plain.prompt_logprobs is None
    assert single.prompt_logprobs == [None]


def test_zero_top_keeps_the_actual_token_alone(tiny) -> None:
    path, hf = tiny
    llm = LLM(str(path), graph_mode="eager", **FP32)
    out = llm.generate([PREFIX], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    expected = hf_logprobs(hf, PREFIX)
    assert all(list(e) == [PREFIX[q]] for q, e in enumerate(out.prompt_logprobs) if q)
    assert abs(out.prompt_logprobs[-1][PREFIX[-1]].logprob - expected[-2, PREFIX[-1]].item()) < 1e-4


@pytest.mark.parametrize("value", [-1, 21])
def test_prompt_logprobs_out_of_range_are_refused_naming_the_field(value: int) -> None:
    from kiln.errors import RequestError

    with pytest.raises(RequestError, match="prompt_logprobs") as exc:
        SamplingParams(prompt_logprobs=value)
    assert exc.value.param == "prompt_logprobs"


@pytest.mark.parametrize("caching", [True, False])
def test_preempted_requests_keep_exact_prompt_logprobs(tiny, caching: bool) -> None:
    """Six prompts sharing a prefix at once, in 8-token chunks, in a pool too small for all of them: requests are
    preempted and recomputed (each position is kept once, from whichever pass scored it first) and every prompt's
    logprobs are still HF's."""
    path, hf = tiny
    prompts = [PREFIX + [40 + i] * (i + 1) for i in range(6)]
    small = dict(num_kv_blocks=14, max_num_seqs=6, max_num_batched_tokens=8, enable_chunked_prefill=True)
    llm = LLM(str(path), graph_mode="eager", enable_prefix_caching=caching, **{**FP32, **small})
    outs = llm.generate(prompts, asking(max_tokens=12))
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert len(out.token_ids) == 12
        assert_hf_prompt_logprobs(hf, prompt, out.prompt_logprobs)
