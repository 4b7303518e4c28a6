"""LoRA through the engine: `LLM(..., enable_lora=True).generate(prompts, params, lora_request=...)` equals HF + PEFT
per request in a batch mixing the base and three adapters over two slots (the third waits for a slot, least recently
used out); graph mode compiles and captures nothing after start-up; the prefix cache never shares blocks between
adapters."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers

from kiln import LLM, LoRARequest, SamplingParams
from kiln.errors import AdapterError, ConfigError
from tests.lora.adapters import reference, reference_greedy

PROMPTS = [[3, 17, 5, 99, 42, 7], [11, 2], [64, 65, 66, 67, 68, 1, 2, 3, 4], [90, 91, 92]]
NAMES = [None, "all7-r4", "qv-r8-rslora", "kod-r2"]
MAX_TOKENS = 5
COMPILE_COUNTERS = ("graphs_traced", "pieces_compiled", "static_compiles", "pieces_captured", "full_graphs_captured")


def _llm(base_dir: Path, cache_dir: Path, graph_mode: str, **options: object) -> LLM:
    settings: dict[str, object] = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "num_kv_blocks": 64}
    if graph_mode != "eager":
        settings.update(compiler="eager", capture_sizes=(1, 2, 4), cache_dir=str(cache_dir))
    return LLM(str(base_dir), block_size=4, graph_mode=graph_mode, **{**settings, **options})


def _requests(adapters: dict[str, Path]) -> list[LoRARequest | None]:
    return [LoRARequest(n, i, str(adapters[n])) if n else None for i, n in enumerate(NAMES)]


@pytest.mark.parametrize("graph_mode", ["eager", "full_and_piecewise"])
def test_generate_with_adapters_equals_hf_peft(
    graph_mode: str, base_dir: Path, adapters: dict[str, Path], hf_base: transformers.PreTrainedModel, tmp_path: Path
) -> None:
    llm = _llm(base_dir, tmp_path, graph_mode, max_cpu_loras=3)
    counters = llm.engine.executor.counters
    started = {name: getattr(counters, name) for name in COMPILE_COUNTERS}
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    outs = llm.generate(PROMPTS, params, lora_request=_requests(adapters))
    for out, prompt, name in zip(outs, PROMPTS, NAMES, strict=True):
        want, _ = reference_greedy(reference(hf_base, adapters[name] if name else None), prompt, MAX_TOKENS)
        assert out.token_ids == want, name
    lora = llm.engine.lora
    assert lora is not None and lora.counters.slot_loads == 3  # three adapters through two slots
    counters.expect(**started)  # adapters moved in and out of slots: no trace, compile or capture


def test_the_prefix_cache_keys_blocks_on_the_adapter(
    base_dir: Path, adapters: dict[str, Path], hf_base: transformers.PreTrainedModel, tmp_path: Path
) -> None:
    llm = _llm(base_dir, tmp_path, "eager")
    prompt = list(range(20, 37))  # 4 full blocks of 4
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    first, second = (LoRARequest(n, i, str(adapters[n])) for i, n in ((1, "all7-r4"), (2, "kod-r2")))
    runs = [(first, "all7-r4"), (second, "kod-r2"), (None, None), (first, "all7-r4")]
    cached = []
    for lora, name in runs:
        out = llm.generate([prompt], params, lora_request=lora)[0]
        want, _ = reference_greedy(reference(hf_base, adapters[name] if name else None), prompt, MAX_TOKENS)
        assert out.token_ids == want
        cached.append(out.num_cached_tokens)
    assert cached == [0, 0, 0, 16]  # only the same adapter again finds the prompt's blocks


def test_adapters_need_enable_lora_and_bad_ones_are_refused(
    base_dir: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    plain = LLM(str(base_dir), num_kv_blocks=16, block_size=4, graph_mode="eager")
    out = plain.generate([[1, 2]], SamplingParams(max_tokens=1), lora_request=LoRARequest("a", 1, str(tmp_path)))
    assert out[0].finish_reason == "error" and "start it with --enable-lora" in out[0].error
    with pytest.raises(ConfigError, match="--max-loras does nothing without --enable-lora"):
        LLM(str(base_dir), max_loras=2, graph_mode="eager")
    with pytest.raises(AdapterError, match="--max-lora-rank 4"):
        _llm(base_dir, tmp_path, "eager", max_lora_rank=4, lora_modules=[f"qv={adapters['qv-r8-rslora']}"])
    with pytest.raises(ConfigError, match="--lora-modules 'qv': expected name=path"):
        _llm(base_dir, tmp_path, "eager", lora_modules=["qv"])


def test_adapters_compose_with_chunked_prefill_and_speculation(
    base_dir: Path, adapters: dict[str, Path], hf_base: transformers.PreTrainedModel, tmp_path: Path
) -> None:
    """A step budget of 6 tokens chunks the prompts; n-gram drafts are verified in their request's slot, next to
    another adapter's request and a second request of the same adapter."""
    llm = _llm(base_dir, tmp_path, "eager", max_num_batched_tokens=6, speculative_method="ngram", prompt_lookup_min=1)
    repeating = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]  # the n-gram proposer drafts from it
    prompts = [repeating, PROMPTS[2], repeating[1:]]
    names = ["qv-r8-rslora", "all7-r4", "qv-r8-rslora"]
    lora = [LoRARequest(n, NAMES.index(n), str(adapters[n])) for n in names]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0), lora_request=lora)
    for out, prompt, name in zip(outs, prompts, names, strict=True):
        assert out.token_ids == reference_greedy(reference(hf_base, adapters[name]), prompt, 8)[0]
    assert llm.engine.speculator is not None and llm.engine.speculator.stats.num_draft_tokens > 0
