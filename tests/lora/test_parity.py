"""kiln with PEFT adapters equals HF + PEFT: greedy tokens, and logits within 1e-4 in fp32, for each adapter (ranks
2 to 8; target subsets from one layer to all seven; alpha, rsLoRA, per-layer patterns) and the base alone; eager,
piecewise graph mode and full decode graphs. One batch mixing the base and three adapters equals each alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from kiln.compile.settings import graph_config_from
from kiln.executor.eager import EagerExecutor
from kiln.executor.graph import GraphExecutor
from kiln.lora import BASE_ONLY, LoRALimits, attach_lora, read_adapter
from tests.lora.adapters import kiln_model, reference, reference_greedy
from tests.lora.conftest import ADAPTERS
from tests.lora.steps import Stepper

NAMES = list(ADAPTERS)  # loaded in slots 0, 1, 2, 3
PROMPTS = [[3, 17, 5, 99, 42, 7], [11, 2], [64, 65, 66, 67, 68, 1, 2, 3, 4], [90]]
MIXED_SLOTS = [BASE_ONLY, 0, 2, 3]  # the base and three adapters, one prompt each
MAX_TOKENS = 6
Expected = dict[tuple[str | None, int], tuple[list[int], torch.Tensor]]


@pytest.fixture(scope="module")
def expected(hf_base: transformers.LlamaForCausalLM, adapters: dict[str, Path]) -> Expected:
    """HF + PEFT greedy tokens and logits per (adapter or None, prompt index)."""
    out: Expected = {}
    for name in [None, *NAMES]:
        model = reference(hf_base, adapters[name] if name else None)
        for i, prompt in enumerate(PROMPTS):
            out[name, i] = reference_greedy(model, prompt, MAX_TOKENS)
    for name in NAMES:  # each adapter changes what the model computes, or the test could not fail
        assert (out[name, 0][1] - out[None, 0][1]).abs().max() > 1e-2
    return out


@pytest.fixture(scope="module", params=["eager", "piecewise", "full_and_piecewise"])
def stepper(
    request: pytest.FixtureRequest, lora_dir: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Stepper:
    model = kiln_model(lora_dir / "base")
    slots = attach_lora(model, LoRALimits(max_loras=len(NAMES), max_rank=8, max_num_tokens=64))
    for slot, name in enumerate(NAMES):
        slots.load(slot, read_adapter(adapters[name]))
    cache_dir = str(tmp_path_factory.mktemp("cache"))
    if request.param == "eager":  # with its kernel plan (weight layouts, the one-row head), as an engine runs it
        return Stepper(model, EagerExecutor(cache_dir=cache_dir), slots)
    config = graph_config_from(
        None,
        cache_dir=cache_dir,
        capture_sizes=(1, 2, 4),
        compile_sizes=(),
        mode=request.param,
        compiler="eager",
    )
    return Stepper(model, GraphExecutor(config), slots)


def _check(got: tuple[list[int], torch.Tensor], want: tuple[list[int], torch.Tensor]) -> None:
    assert got[0] == want[0]
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-4)


@pytest.mark.parametrize("slot", [BASE_ONLY, *range(len(NAMES))])
def test_each_adapter_equals_hf_peft(stepper: Stepper, expected: Expected, slot: int) -> None:
    name = NAMES[slot] if slot != BASE_ONLY else None
    tokens, logits = stepper.generate(PROMPTS[:1], [slot], MAX_TOKENS)
    _check((tokens[0], logits[0]), expected[name, 0])


def test_a_mixed_batch_equals_each_request_alone(stepper: Stepper, expected: Expected) -> None:
    executor = stepper.executor
    replays = _captured_replays(executor)
    tokens, logits = stepper.generate(PROMPTS, MIXED_SLOTS, MAX_TOKENS)
    # in graph mode the mixed decode steps ran captured code: the pieces' captures or the full decode graph
    assert _captured_replays(executor) - replays >= (MAX_TOKENS - 1 if isinstance(executor, GraphExecutor) else 0)
    for i, slot in enumerate(MIXED_SLOTS):
        alone_tokens, alone_logits = stepper.generate([PROMPTS[i]], [slot], MAX_TOKENS)
        _check((tokens[i], logits[i]), (alone_tokens[0], alone_logits[0]))
        _check((tokens[i], logits[i]), expected[NAMES[slot] if slot != BASE_ONLY else None, i])


def _captured_replays(executor: object) -> int:
    if not isinstance(executor, GraphExecutor):
        return 0
    return executor.counters.full_replays if executor.full is not None else executor.counters.replays
