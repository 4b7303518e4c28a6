"""Dropping an `LLM` frees its model at once, without waiting for the cycle collector: no object of the engine
holds itself in a reference cycle that keeps the weights alive (a step shaper's lru_cache over its own bound method
once held the executor, and with it the model, until the next full collection)."""

from __future__ import annotations

import gc
import weakref

from kiln import LLM, SamplingParams


def test_dropping_an_llm_frees_its_model_without_the_collector() -> None:
    gc.collect()
    gc.disable()
    try:
        llm = LLM("default", graph_mode="eager", num_kv_blocks=32)
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))
        model = weakref.ref(llm.engine.runner.model)
        del llm
        assert model() is None, "the model outlived its LLM: a reference cycle holds it"
    finally:
        gc.enable()
