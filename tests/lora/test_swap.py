"""Loading, swapping and clearing adapters in a running graph-mode model (inductor, full decode graphs and captured
pieces) is a copy into the static buffers: the compile counters show no trace, compile or capture after start-up,
and every step computes what HF + PEFT computes for the adapter its slot holds at that moment."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from kiln.compile.settings import graph_config_from
from kiln.executor.graph import GraphExecutor
from kiln.lora import BASE_ONLY, LoRALimits, attach_lora, read_adapter
from tests.lora.adapters import kiln_model, reference, reference_greedy
from tests.lora.steps import Stepper

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42]]
MAX_TOKENS = 4
# what start-up does and a step never may
COMPILE_COUNTERS = (
    "graphs_traced",
    "pieces_seen",
    "pieces_compiled",
    "cache_hits",
    "static_compiles",
    "static_cache_hits",
    "pieces_captured",
    "full_graphs_captured",
)


def _want(hf_base: transformers.LlamaForCausalLM, adapter: Path | None) -> list[tuple[list[int], torch.Tensor]]:
    model = reference(hf_base, adapter)
    return [reference_greedy(model, prompt, MAX_TOKENS) for prompt in PROMPTS]


def _run_and_check(stepper: Stepper, slots: list[int], want: list[tuple[list[int], torch.Tensor]]) -> None:
    tokens, logits = stepper.generate(PROMPTS, slots, MAX_TOKENS)
    for i, (want_tokens, want_logits) in enumerate(want):
        assert tokens[i] == want_tokens
        torch.testing.assert_close(logits[i], want_logits, rtol=0, atol=1e-4)


def test_load_swap_clear_never_recompile(
    hf_base: transformers.LlamaForCausalLM, adapters: dict[str, Path], lora_dir: Path, tmp_path: Path
) -> None:
    model = kiln_model(lora_dir / "base")
    slots = attach_lora(model, LoRALimits(max_loras=2, max_rank=8, max_num_tokens=64))
    config = graph_config_from(
        None,
        cache_dir=str(tmp_path),
        capture_sizes=(1, 2, 4),
        compile_sizes=(),
        mode="full_and_piecewise",
        compiler="inductor",
    )
    executor = GraphExecutor(config)
    stepper = Stepper(model, executor, slots)  # start-up: trace, compile, capture with every slot empty
    started = {name: getattr(executor.counters, name) for name in COMPILE_COUNTERS}
    assert started["pieces_compiled"] > 0 and started["pieces_captured"] > 0

    base = _want(hf_base, None)
    _run_and_check(stepper, [BASE_ONLY, BASE_ONLY], base)
    slots.load(0, read_adapter(adapters["all7-r4"]))
    _run_and_check(stepper, [0, 0], _want(hf_base, adapters["all7-r4"]))
    slots.load(0, read_adapter(adapters["kod-r2"]))  # swapped in the same slot
    kod = _want(hf_base, adapters["kod-r2"])
    _run_and_check(stepper, [0, 0], kod)
    slots.load(1, read_adapter(adapters["qv-r8-rslora"]))
    qv = _want(hf_base, adapters["qv-r8-rslora"])
    _run_and_check(stepper, [1, 0], [qv[0], kod[1]])
    slots.clear(0)
    _run_and_check(stepper, [0, 1], [base[0], qv[1]])  # a cleared slot runs the base alone

    executor.counters.expect(**started)
    assert executor.counters.full_replays > 0 and executor.counters.dynamic_fallbacks > 0


def test_token_slots_out_of_range_are_refused(lora_dir: Path) -> None:
    slots = attach_lora(kiln_model(lora_dir / "base"), LoRALimits(max_loras=2, max_rank=4, max_num_tokens=8))
    with pytest.raises(ValueError, match=r"token slots must lie in \[-1, 1\]"):
        slots.set_token_slots([0, 2])
    with pytest.raises(ValueError, match="a step of 9 tokens: the LoRA buffers hold 8"):
        slots.set_token_slots([0] * 9)
    with pytest.raises(ValueError, match="LoRA slot 2: the engine holds slots 0 to 1"):
        slots.clear(2)
