"""Automatic prefix caching end to end on a tiny random Llama: prompts that share a prefix take its KV blocks from
the cache and prefill only the rest, in eager, piecewise and full_and_piecewise modes, under chunked prefill and
preemption, and `n > 1` choices prefill their prompt once.

Every greedy token is checked against HF transformers' own forward (so a wrongly shared block would show), the same
workload runs with caching off for the tokens and logprobs, and after every run each block is free or cached and
evictable with no reference left. Logprobs are compared to 1e-4: a cached prefix's K/V were computed in another
step's batch, whose matrix products may round differently in the last bits (vLLM's tests allow the same).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.engine.core import EngineCore
from kiln.engine.scheduling.prefix_cache import KEY_FUNCTIONS
from tests.engine.tiny_models import write_hf_model

BLOCK = 4
PREFIX = [(7 * i) % 200 + 3 for i in range(37)]  # 9 full blocks and one token
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("tiny_llama")
    return path, write_hf_model(path, "llama", perturb=0.05)


def assert_hf_greedy(hf: torch.nn.Module, prompt: list[int], tokens: list[int]) -> None:
    """Each token is HF's argmax after the prompt and the tokens before it."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    assert tokens == logits.argmax(-1).tolist()


def assert_no_block_held(engine: EngineCore) -> None:
    pool = engine.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(pool.ref_count(b) == 0 for b in range(pool.num_blocks))


def turns(llm: LLM) -> list[tuple[list[int], list[int], list[dict[int, float]], int]]:
    """A workload one request at a time: a prompt, another with its prefix, the first again (every block cached),
    then the first turn's prompt and answer with a new question (a multi-turn chat); each with its cached tokens."""
    done = []
    prompts = [[*PREFIX, 11, 12, 13], [*PREFIX, 21, 22], [*PREFIX, 11, 12, 13]]
    for prompt in prompts:
        out = llm.generate([prompt], GREEDY)[0]
        done.append((prompt, out.token_ids, out.logprobs, out.num_cached_tokens))
    first = done[0]
    follow_up = first[0] + first[1] + [31, 32, 33, 34, 35]
    out = llm.generate([follow_up], GREEDY)[0]
    done.append((follow_up, out.token_ids, out.logprobs, out.num_cached_tokens))
    return done


def assert_same_runs(on: list, off: list) -> None:
    for (prompt, tokens, lps, *_), (_, tokens_off, lps_off, *_) in zip(on, off, strict=True):
        assert tokens == tokens_off, prompt
        for step, step_off in zip(lps, lps_off, strict=True):
            assert step.keys() == step_off.keys()
            assert all(abs(step[t] - step_off[t]) < 1e-4 for t in step)


@pytest.mark.parametrize("mode", ["eager", "piecewise", "full_and_piecewise"])
def test_cached_prefixes_give_the_tokens_of_no_cache_in_every_mode(tiny, mode: str) -> None:
    path, hf = tiny
    graph = {} if mode == "eager" else dict(compiler="eager", capture_sizes=(1, 2, 4))
    runs = {}
    for caching in (True, False):
        llm = LLM(
            str(path), block_size=BLOCK, num_kv_blocks=64, graph_mode=mode, enable_prefix_caching=caching, **graph
        )
        runs[caching] = turns(llm)
        engine = llm.engine
        assert_no_block_held(engine)
        if caching:
            stats = engine.scheduler.prefix.stats
            # the second and third prompts find the prefix's 9 blocks (the third: its whole prompt but the last
            # token, whose block is recomputed); the follow-up finds the first turn's prompt and answer blocks
            follow_up = (len(PREFIX) + 3 + 6 - 1) // BLOCK * BLOCK
            assert stats.hits == 9 * BLOCK + 9 * BLOCK + follow_up
            assert [run[3] for run in runs[True]] == [0, 9 * BLOCK, 9 * BLOCK, follow_up]  # each output's count
            assert engine.pool.num_cached_blocks > 0
            if mode == "full_and_piecewise":
                assert engine.executor.counters.full_replays > 0
        else:
            assert engine.scheduler.prefix is None and engine.pool.num_cached_blocks == 0
            assert all(run[3] == 0 for run in runs[False])
    assert_same_runs(runs[True], runs[False])
    for prompt, tokens, *_ in runs[True]:
        assert_hf_greedy(hf, prompt, tokens)


def test_builtin_block_keys_cache_and_compute_as_sha256_keys_do(tiny) -> None:
    """`--prefix-caching-hash-algo builtin`: the engine names its blocks with Python's hash and finds the same
    prefixes (the same cached counts), with the tokens and logprobs of the sha256 keys."""
    path, hf = tiny
    runs = {}
    for algo in ("sha256", "builtin"):
        llm = LLM(str(path), block_size=BLOCK, num_kv_blocks=64, graph_mode="eager", prefix_caching_hash_algo=algo)
        assert llm.engine.scheduler.prefix.keys.key_function is KEY_FUNCTIONS[algo]
        runs[algo] = turns(llm)
        assert_no_block_held(llm.engine)
    assert [run[3] for run in runs["builtin"]] == [run[3] for run in runs["sha256"]]
    assert runs["builtin"][1][3] == 9 * BLOCK  # the shared prefix was found
    assert_same_runs(runs["builtin"], runs["sha256"])
    for prompt, tokens, *_ in runs["builtin"]:
        assert_hf_greedy(hf, prompt, tokens)


def test_chunked_and_preempted_requests_with_cached_prefixes(tiny) -> None:
    """Six prompts with one prefix at once, in 8-token chunks, in a pool too small for all of them: requests are
    preempted and recomputed (finding their own blocks cached), and the tokens are those of caching off."""
    path, hf = tiny
    prompts = [PREFIX + [40 + i] * (i + 1) for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    small = dict(block_size=BLOCK, num_kv_blocks=30, max_num_seqs=6, max_num_batched_tokens=8, graph_mode="eager")
    outs = {}
    for caching in (True, False):
        llm = LLM(str(path), enable_prefix_caching=caching, **small)
        outs[caching] = [
            (p, o.token_ids, o.logprobs) for p, o in zip(prompts, llm.generate(prompts, params), strict=True)
        ]
        assert llm.engine.scheduler.num_preemptions > 0
        assert_no_block_held(llm.engine)
        if caching:
            assert llm.engine.scheduler.prefix.stats.hits >= 5 * 9 * BLOCK  # every prompt after the first
    assert_same_runs(outs[True], outs[False])
    for prompt, tokens, _ in outs[True]:
        assert_hf_greedy(hf, prompt, tokens)


def n_choices(engine: EngineCore, prompt: list[int], n: int, group: str | None) -> list[list[int]]:
    """`n` seeded sampled choices of `prompt` (one client request when `group` is given, else n of their own)."""
    for i in range(n):
        params = SamplingParams(max_tokens=8, temperature=1.0, seed=100 + i, ignore_eos=True)
        engine.add_request(f"c{i}", prompt, params, group=group)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished:
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return [done[f"c{i}"] for i in range(n)]


def test_n_choices_prefill_their_prompt_once(tiny) -> None:
    """n=4: the first choice prefills the prompt, the others copy its partial last block and recompute only the
    prompt's last token; each choice samples as a request of its own with its seed would."""
    path, _ = tiny
    prompt = [*PREFIX, 11, 12]  # 39 tokens: 9 full blocks and a partial one of 3 tokens
    shared = LLM(str(path), block_size=BLOCK, num_kv_blocks=64, graph_mode="eager").engine
    copies = []
    execute = shared.runner.execute
    shared.runner.execute = lambda sched, *probs: copies.extend(sched.block_copies) or execute(sched, *probs)
    choices = n_choices(shared, prompt, 4, group="g")
    stats = shared.scheduler.prefix.stats
    assert stats.queries - stats.hits == len(prompt) + 3  # the prompt once, then its last token per sibling
    assert len(copies) == 3 and len({dst for _, dst in copies}) == 3 and len({src for src, _ in copies}) == 1
    assert_no_block_held(shared)
    alone = LLM(str(path), block_size=BLOCK, num_kv_blocks=64, graph_mode="eager", enable_prefix_caching=False)
    assert choices == n_choices(alone.engine, prompt, 4, group=None)
    assert len({tuple(c) for c in choices}) > 1  # different seeds: the choices differ


def test_finished_aborted_and_failed_requests_leave_no_block_held(tiny) -> None:
    path, _ = tiny
    llm = LLM(str(path), block_size=BLOCK, num_kv_blocks=64, graph_mode="eager")
    engine = llm.engine
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"r{i}", [*PREFIX, 50 + i], params)
    for _ in range(3):
        engine.step()
    engine.abort("r1")
    engine.fail("r2", "injected")
    while engine.has_unfinished:
        engine.step()
    assert_no_block_held(engine)
    cached = engine.pool.num_cached_blocks
    assert cached >= 9  # the prefix stays cached, evictable
    assert engine.reset_prefix_cache() == cached and engine.pool.num_cached_blocks == 0
    out = llm.generate([[*PREFIX, 60]], params)[0]  # after the reset nothing is found: the whole prompt is computed
    assert out.error is None and engine.scheduler.prefix.stats.resets == 1
