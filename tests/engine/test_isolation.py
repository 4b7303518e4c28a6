"""One request can never hurt another: bounded sampling parameters, per-row sampling failures, step failures
isolated to the request that causes them, min_tokens over stop strings, fresh seeds, slow readers cut off."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kiln.config import CacheConfig, EngineConfig
from kiln.engine.core import EngineCore
from kiln.engine.sampling.sampling_params import SamplingParams
from kiln.engine.serving.async_engine import AsyncEngine
from kiln.engine.serving.llm import LLM
from kiln.errors import INTERNAL_ERROR, RequestError
from kiln.executor.eager import EagerExecutor
from kiln.model.forward_context import ModelInputs
from tests.compile.tiny import tiny_model

POISON = 77  # a token id the tests make harmful
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = {"a": [5, 6, 7], "b": [9, 10, 11, 12], "c": [20, 21]}


class RaisingExecutor(EagerExecutor):
    """The model's forward, except that a batch holding POISON raises (a kernel failing on some input)."""

    def forward(self, batch: ModelInputs) -> torch.Tensor:
        if bool((batch.input_ids[: batch.metadata.num_actual_tokens] == POISON).any()):
            raise RuntimeError("index 1000000000 is out of bounds for dimension 0")
        return super().forward(batch)


def make_engine(executor: EagerExecutor | None = None, seed: int | None = 0, **model_kw: object) -> EngineCore:
    model = tiny_model(num_layers=2, **model_kw)
    config = EngineConfig(seed=seed, cache=CacheConfig(block_size=4, num_blocks=64))
    return EngineCore(config, model, None, executor or EagerExecutor(keep_layout=True)).prepare()


def run(engine: EngineCore, prompts: dict[str, list[int]], params: SamplingParams = GREEDY) -> dict:
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    final = {}
    while engine.has_unfinished:
        final.update({o.request_id: o for o in engine.step() if o.finished})
    return final


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("temperature", 3.0, "must be in [0, 2]"),
        ("temperature", float("nan"), "must be a finite number"),
        ("repetition_penalty", 1e-40, "must be in [0.01, 100]"),
        ("repetition_penalty", 1e9, "must be in [0.01, 100]"),
        ("seed", 2**70, "signed 64-bit"),
        ("stop_token_ids", [-3], "must be token ids"),
    ],
)
def test_sampling_parameters_are_bounded(field: str, value: object, rule: str) -> None:
    with pytest.raises(RequestError, match=f"{field}=.*{rule.replace('[', '.').replace(']', '.')}"):
        SamplingParams(**{field: value})


def test_a_vanishing_temperature_is_greedy() -> None:
    assert SamplingParams(temperature=1e-45).is_greedy
    engine = make_engine()
    tiny_t = run(engine, {"x": [1, 2, 3]}, SamplingParams(temperature=1e-45, max_tokens=6, ignore_eos=True))
    assert tiny_t["x"].token_ids == run(make_engine(), {"x": [1, 2, 3]})["x"].token_ids


def test_stop_token_ids_outside_the_vocabulary_are_refused_and_change_nothing() -> None:
    engine = make_engine()
    params = SamplingParams(min_tokens=1, stop_token_ids=[1_000_000_000], max_tokens=4)
    with pytest.raises(RequestError, match=r"stop token id 1000000000 is outside the vocabulary \[0, 128\)"):
        engine.add_request("bad", [1, 2], params)
    assert not engine.requests and engine.pool.num_used_blocks == 0


def test_non_finite_logits_fail_that_request_alone() -> None:
    alone = run(make_engine(), PROMPTS)
    engine = make_engine()
    engine.model.model.embed_tokens.weight[POISON] = float("nan")  # attention keeps NaN inside its sequence
    out = run(engine, {**PROMPTS, "poisoned": [1, POISON, 2]})
    assert out["poisoned"].finish_reason == "error" and "non-finite logits" in out["poisoned"].error
    assert {rid: o.token_ids for rid, o in out.items() if rid != "poisoned"} == {
        rid: o.token_ids for rid, o in alone.items()
    }
    assert all(o.finish_reason == "length" for rid, o in out.items() if rid != "poisoned")
    assert engine.pool.num_used_blocks == 0


def test_a_failing_step_fails_only_the_request_it_comes_from(caplog: pytest.LogCaptureFixture) -> None:
    alone = run(make_engine(), PROMPTS)
    engine = make_engine(RaisingExecutor(keep_layout=True))
    out = run(engine, {**PROMPTS, "poisoned": [1, 2, POISON]})
    assert out["poisoned"].finish_reason == "error" and out["poisoned"].error == INTERNAL_ERROR
    assert "out of bounds" not in out["poisoned"].error  # internals go to the log, not to the client
    assert "out of bounds" in caplog.text and "poisoned" in caplog.text
    assert {rid: o.token_ids for rid, o in out.items() if rid != "poisoned"} == {
        rid: o.token_ids for rid, o in alone.items()
    }
    assert engine.pool.num_used_blocks == 0 and not engine.requests


def test_unseeded_requests_get_fresh_randomness_unless_the_engine_is_seeded() -> None:
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    fresh = [run(make_engine(seed=None), {"r": [1, 2, 3]}, params)["r"].token_ids for _ in range(2)]
    seeded = [run(make_engine(seed=7), {"r": [1, 2, 3]}, params)["r"].token_ids for _ in range(2)]
    assert fresh[0] != fresh[1]
    assert seeded[0] == seeded[1]


def test_min_tokens_holds_off_stop_strings(llm: LLM) -> None:
    prompt = "The capital of France is"
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0]
    stop = free.text.strip().split()[0]  # a word the model says at once
    assert stop
    early = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop=[stop]))[0]
    held = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop=[stop], min_tokens=8))[0]
    assert len(early.token_ids) < 8 and stop not in early.text
    assert len(held.token_ids) >= 8 and held.text.startswith(free.text[: free.text.index(stop) + len(stop)])


def test_a_slow_reader_is_cut_off_and_its_blocks_freed() -> None:
    engine = make_engine()

    async def main() -> list:
        served = AsyncEngine(engine, max_buffered_outputs=3)
        served.start()
        try:
            stream = await served.add_requests([("slow", [1, 2, 3], SamplingParams(max_tokens=40, ignore_eos=True))])
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while stream.queue.qsize() <= 3 and loop.time() < deadline:  # the reader takes nothing meanwhile
                await asyncio.sleep(0.01)
            outs = [out async for out in stream]
            while served.stats().num_kv_blocks_used and loop.time() < deadline:
                await asyncio.sleep(0.01)
            return outs
        finally:
            await served.stop()

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].finish_reason == "slow_reader" and "too slowly" in outs[-1].error
    assert len(outs) <= 4 and engine.pool.num_used_blocks == 0
