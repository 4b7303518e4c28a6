"""LoRA adapters on several devices, split as their base layers (kiln.lora.targets): two gloo ranks (this process
and one it spawns) under tensor and under pipeline parallelism give one process's greedy tokens and log-probabilities
for a batch mixing the base and three adapters over two slots (the other rank repeats each slot load rank 0 makes,
reading the adapter itself), an adapter loaded at run time included; and a follower's side of that in one process:
each load is made once, a load a rank made itself is skipped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln import LLM, LoRARequest, SamplingParams
from kiln.distributed.state import rank_state
from kiln.engine.request import RequestOutput
from kiln.lora import LoRALimits, LoRAManager, attach_lora
from kiln.lora.manager import SlotLoad
from tests.lora.adapters import kiln_model

PROMPTS = [[3, 17, 5, 99, 42, 7], [11, 2], [64, 65, 66, 67, 68, 1, 2, 3, 4], [90, 91, 92], [8, 9, 10, 11]]
NAMES = [None, "all7-r4", "qv-r8-rslora", "kod-r2", "gate-up-patterns"]
PARAMS = SamplingParams(max_tokens=5, temperature=0, logprobs=3)
SETTINGS = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "block_size": 4, "graph_mode": "eager"}


def _requests(adapters: dict[str, Path]) -> list[LoRARequest | None]:
    return [LoRARequest(n, i, str(adapters[n])) if n else None for i, n in enumerate(NAMES[:4])]


def _run(llm: LLM, adapters: dict[str, Path]) -> list[RequestOutput]:
    """The four mixed requests, then one of an adapter loaded at run time (through rank 0's engine)."""
    outs = llm.generate(PROMPTS[:4], PARAMS, lora_request=_requests(adapters))
    loaded = llm.engine.load_lora("late", str(adapters["gate-up-patterns"]))
    return outs + llm.generate(PROMPTS[4:], PARAMS, lora_request=loaded)


@pytest.fixture(scope="module")
def one_process(base_dir: Path, adapters: dict[str, Path]) -> list[RequestOutput]:
    return _run(LLM(str(base_dir), **SETTINGS), adapters)


def _assert_same(outs: list[RequestOutput], reference: list[RequestOutput]) -> None:
    for out, ref, name in zip(outs, reference, NAMES, strict=True):
        assert out.token_ids == ref.token_ids, name
        assert out.logprobs is not None and ref.logprobs is not None
        for mine, theirs in zip(out.logprobs, ref.logprobs, strict=True):
            assert mine.keys() == theirs.keys(), name
            assert max(abs(mine[t] - theirs[t]) for t in mine) < 1e-4, name


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp", "pp"])
def test_two_ranks_equal_one_process(
    layout: dict[str, int], base_dir: Path, adapters: dict[str, Path], one_process: list[RequestOutput]
) -> None:
    with LLM(str(base_dir), **SETTINGS, **layout) as llm:
        outs = _run(llm, adapters)
        lora = llm.engine.lora
        assert lora is not None and lora.counters.slot_loads == 4  # four adapters through two slots
        model = llm.engine.model
        if "tensor_parallel_size" in layout:
            # rank 0 holds 2 of 4 query heads and 1 of 2 KV heads (rows of qkv's A stay whole), half the MLP columns
            attn = model.model.layers[0].self_attn
            assert attn.qkv_proj.lora_b.shape == (2 * 8, (2 + 1 + 1) * 16)
            assert attn.o_proj.lora_a.shape == (2 * 8, 2 * 16) and attn.o_proj.lora_b.shape == (2 * 8, 64)
            assert model.model.layers[0].mlp.down_proj.lora_a.shape == (2 * 8, 48)
        else:
            assert not hasattr(model.model.layers[2], "mlp")  # the other stage's layer: its adapters load there
    assert rank_state() is None
    _assert_same(outs, one_process)


def test_a_follower_repeats_each_load_once(base_dir: Path, adapters: dict[str, Path]) -> None:
    limits = LoRALimits(max_loras=2, max_rank=8, max_num_tokens=16)
    leader = LoRAManager(attach_lora(kiln_model(base_dir), limits), max_cpu_loras=3)
    follower = LoRAManager(attach_lora(kiln_model(base_dir), limits), max_cpu_loras=2)
    for i, name in enumerate(["all7-r4", "kod-r2", "qv-r8-rslora"], start=1):
        leader.add(LoRARequest(name, i, str(adapters[name])))
    leader.step_slots([1, 2])
    first = leader.take_loads()
    assert first == [SlotLoad(0, 1, str(adapters["all7-r4"])), SlotLoad(1, 2, str(adapters["kod-r2"]))]
    leader.follow(first)  # its own loads, run as planned: nothing read, nothing copied
    leader.step_slots([3, None])  # slot 0 (all7, least recently used) takes qv
    second = leader.take_loads()
    assert second == [SlotLoad(0, 3, str(adapters["qv-r8-rslora"]))] and leader.take_loads() == []
    leader.follow(second)
    assert (leader.counters.host_reads, leader.counters.slot_loads) == (3, 3)

    follower.follow(first)
    follower.follow(first)  # a plan seen again (pipeline parts): held already
    follower.follow(second)
    assert (follower.counters.host_reads, follower.counters.slot_loads) == (3, 3)
    for name, layer in leader.slots.layers.items():
        theirs = follower.slots.layers[name]
        assert torch.equal(layer.lora_a, theirs.lora_a) and torch.equal(layer.lora_b, theirs.lora_b), name
