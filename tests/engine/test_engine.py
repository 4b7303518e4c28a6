"""Engine behaviour on the default model: batching, chunking, preemption, aborts, sampling, stops, bad input."""

from __future__ import annotations

import pytest

from kiln import LLM, SamplingParams
from kiln.errors import RequestError

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of robotics are",
    "import numpy as np\n",
    "Q: What is the boiling point of water?\nA:",
    "My favourite colour is",
    "Translate to French: Good morning, how are you?",
]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(llm: LLM) -> list[list[int]]:
    return [llm.generate(p, GREEDY)[0].token_ids for p in PROMPTS]


def test_batch_invariance(llm: LLM, alone: list[list[int]]) -> None:
    together = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert together == alone
    assert llm.engine.pool.num_used_blocks == 0


def test_chunked_prefill_and_mixed_batches_match() -> None:
    small = LLM("default", max_num_batched_tokens=7, graph_mode="eager")  # forces prompt chunks mixed with decodes
    steps_with_mix = 0
    engine = small.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, GREEDY)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished:
        sched = engine.scheduler.schedule()
        sizes = [s.num_new_tokens for s in sched.scheduled]
        steps_with_mix += 1 in sizes and any(n > 1 for n in sizes)
        result = engine.runner.execute(sched)
        for out in engine.update(sched, result):
            if out.finished:
                tokens[out.request_id] = out.token_ids
    reference = LLM("default", graph_mode="eager").generate(PROMPTS, GREEDY)
    assert [tokens[str(i)] for i in range(len(PROMPTS))] == [r.token_ids for r in reference]
    assert steps_with_mix > 0
    assert engine.pool.num_used_blocks == 0


def test_preemption_under_tiny_block_budget(alone: list[list[int]]) -> None:
    tiny = LLM(
        "default", block_size=4, num_kv_blocks=14, graph_mode="eager"
    )  # 56 tokens: only a few prompts fit at once
    outs = tiny.generate(PROMPTS, GREEDY)
    assert tiny.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == alone
    assert tiny.engine.pool.num_used_blocks == 0


def test_abort_returns_blocks(llm: LLM) -> None:
    engine = llm.engine
    for i in range(3):
        engine.add_request(f"a{i}", PROMPTS[i], SamplingParams(max_tokens=50, temperature=0))
    engine.step()
    engine.step()
    assert engine.pool.num_used_blocks > 0
    for i in range(3):
        out = engine.abort(f"a{i}")
        assert out is not None and out.finish_reason == "abort"
    assert engine.pool.num_used_blocks == 0 and not engine.has_unfinished


def test_seeded_sampling_is_reproducible(llm: LLM) -> None:
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    first = llm.generate(PROMPTS[:3], params)
    again = llm.generate(PROMPTS[:3], params)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    other = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True))
    assert [o.token_ids for o in other] != [o.token_ids for o in first]


def test_seeded_sampling_is_independent_of_batch(llm: LLM) -> None:
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=7, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], params)[0].token_ids
    batched = llm.generate(PROMPTS[:4], params)[0].token_ids
    assert alone == batched


def test_top_k_one_equals_greedy(llm: LLM, alone: list[list[int]]) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.9, top_k=1, seed=3, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(PROMPTS[:4], params)] == alone[:4]


def test_filters_keep_the_top_token(llm: LLM, alone: list[list[int]]) -> None:
    """top_p and min_p so tight that only the argmax survives must reproduce greedy."""
    for params in (
        SamplingParams(max_tokens=12, temperature=1.0, top_p=1e-6, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=1.0, min_p=0.999999, seed=5, ignore_eos=True),
    ):
        assert [o.token_ids for o in llm.generate(PROMPTS[:2], params)] == alone[:2]


def test_penalties_change_output(llm: LLM, alone: list[list[int]]) -> None:
    penalized = llm.generate(
        PROMPTS[2], SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.8, ignore_eos=True)
    )[0]
    assert penalized.token_ids != alone[2]
    freq = llm.generate(
        PROMPTS[2],
        SamplingParams(max_tokens=12, temperature=0, frequency_penalty=2.0, presence_penalty=2.0, ignore_eos=True),
    )[0]
    assert len(set(freq.token_ids)) == len(freq.token_ids)  # any repeat would have been pushed down hard


def test_stop_string_cuts_text(llm: LLM) -> None:
    full = llm.generate(PROMPTS[1], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0].text
    stop = full[5:9]
    assert stop and full.index(stop) == 5
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=24, temperature=0, stop=[stop], ignore_eos=True))[0]
    assert out.text == full[:5]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(
        PROMPTS[1],
        SamplingParams(max_tokens=24, temperature=0, stop=[stop], include_stop_str_in_output=True, ignore_eos=True),
    )[0]
    assert kept.text == full[:9]


def test_streamed_deltas_add_up_and_never_show_a_stop_string(llm: LLM) -> None:
    full = llm.generate(PROMPTS[1], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0].text
    stop = full[10:16]
    deltas = [o.delta for o in llm.stream(PROMPTS[1], SamplingParams(max_tokens=24, temperature=0, stop=[stop]))]
    assert "".join(deltas) == full[:10]


def test_stop_token_ids_and_max_tokens(llm: LLM, alone: list[list[int]]) -> None:
    target = alone[0][3]
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[target]))[0]
    assert out.token_ids == alone[0][: alone[0].index(target) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target
    # the stopping token's text is not output (as vLLM), unless include_stop_str_in_output
    assert out.text == llm.tokenizer.decode(out.token_ids[:-1]) != llm.tokenizer.decode(out.token_ids)
    kept = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[target], include_stop_str_in_output=True)
    assert llm.generate(PROMPTS[0], kept)[0].text == llm.tokenizer.decode(out.token_ids)
    assert llm.generate(PROMPTS[0], SamplingParams(max_tokens=3, temperature=0))[0].finish_reason == "length"


def test_prompt_over_max_model_len_fails_only_that_request() -> None:
    short = LLM("default", max_model_len=64, graph_mode="eager")
    # the engine's config is resolved: quantization auto decided by the checkpoint (a Q4_1 GGUF: packed)
    assert (short.engine.config.max_model_len, short.engine.config.quantization) == (64, "packed")
    outs = short.generate(["word " * 80, PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0))
    assert outs[0].finish_reason == "error"
    assert "max_model_len=64" in outs[0].error and "+ max_tokens (8)" in outs[0].error
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 8


def test_bad_requests_are_refused_with_the_field(llm: LLM) -> None:
    limit = llm.engine.max_model_len
    assert llm.engine.config.max_model_len == limit == llm.engine.config.graph.max_model_len  # resolved once
    singular = rf"^prompt \(1 token\) \+ max_tokens \({limit}\) = {limit + 1} tokens exceeds"
    with pytest.raises(RequestError, match=singular):
        llm.engine.make_request("x", [1], SamplingParams(max_tokens=limit))
    with pytest.raises(RequestError, match="empty"):
        llm.engine.make_request("x", "", SamplingParams())
    with pytest.raises(RequestError, match="outside the vocabulary"):
        llm.engine.make_request("x", [1, 2, 10**9], SamplingParams())
    for field, value in [("temperature", -1.0), ("top_p", 0.0), ("max_tokens", 0), ("min_p", 2.0), ("top_k", -5)]:
        with pytest.raises(RequestError, match=field) as err:
            SamplingParams(**{field: value})
        assert err.value.param == field


def test_kv_cache_too_small_for_request_is_refused() -> None:
    small = LLM("default", num_kv_blocks=2, block_size=4, graph_mode="eager")
    out = small.generate(PROMPTS[0], SamplingParams(max_tokens=20))[0]
    assert out.finish_reason == "error" and "KV blocks" in out.error


def test_chat_uses_the_template(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(max_tokens=8, temperature=0))[0]
    assert out.prompt.startswith("<|im_start|>system") and out.prompt.endswith("<|im_start|>assistant\n")
    assert out.token_ids
