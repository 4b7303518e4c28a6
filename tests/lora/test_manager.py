"""Adapters -> slots and host copies, least recently used first out (vLLM's --max-loras / --max-cpu-loras), every
move counted; a step naming more adapters than slots, or a bad adapter, is refused and changes nothing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kiln.errors import AdapterError, ConfigError
from kiln.lora import BASE_ONLY, LoRALimits, LoRAManager, LoRARequest, attach_lora
from tests.lora.adapters import kiln_model
from tests.lora.conftest import ADAPTERS


@pytest.fixture
def manager(lora_dir: Path, adapters: dict[str, Path]) -> LoRAManager:
    slots = attach_lora(kiln_model(lora_dir / "base"), LoRALimits(max_loras=2, max_rank=8, max_num_tokens=16))
    manager = LoRAManager(slots, max_cpu_loras=3)
    for i, name in enumerate(ADAPTERS, start=1):
        manager.add(LoRARequest(name, i, str(adapters[name])))
    return manager


def test_slots_and_host_copies_are_least_recently_used_first_out(
    manager: LoRAManager, adapters: dict[str, Path]
) -> None:
    names = list(ADAPTERS)
    manager.counters.expect(host_reads=4, host_evictions=1, slot_loads=0)  # 4 read, 3 kept: id 1 dropped
    assert list(manager.host) == [2, 3, 4]
    assert manager.step_slots([1, None, 2, 1]) == [0, BASE_ONLY, 1, 0]
    manager.counters.expect(host_reads=6, slot_loads=2, slot_evictions=0)  # 1 and 2 read again (2 was dropped for 1)
    assert manager.slots.loaded == {0: str(adapters[names[0]]), 1: str(adapters[names[1]])}
    assert manager.step_slots([3]) == [0]  # the least recently used slot (id 1's) goes
    manager.counters.expect(slot_loads=3, slot_evictions=1)
    assert manager.slots.loaded[0] == str(adapters[names[2]])
    assert manager.step_slots([2, 3]) == [1, 0]  # both in slots: nothing moves
    manager.counters.expect(slot_loads=3, slot_evictions=1)
    assert set(manager.host) >= {2, 3} and len(manager.host) <= 3  # those in slots keep their host copies

    with pytest.raises(ConfigError, match="a step with 3 adapters: the engine holds 2"):
        manager.step_slots([1, 2, 3])
    manager.remove(2)
    assert 1 not in manager.slots.loaded and 2 not in manager.requests
    with pytest.raises(ConfigError, match="LoRA id 2 is not loaded"):
        manager.step_slots([2])


def test_bad_additions_change_nothing(manager: LoRAManager, adapters: dict[str, Path], tmp_path: Path) -> None:
    before = (dict(manager.requests), list(manager.host))
    with pytest.raises(AdapterError, match=r"adapter_config\.json: file: missing"):
        manager.add(LoRARequest("nowhere", 9, str(tmp_path)))
    with pytest.raises(ConfigError, match="LoRA id 1 is already all7-r4"):
        manager.add(LoRARequest("other", 1, str(adapters["kod-r2"])))
    assert (dict(manager.requests), list(manager.host)) == before
    manager.add(LoRARequest("all7-r4", 1, str(adapters["all7-r4"])))  # the same again: a no-op
    with pytest.raises(ConfigError, match="--max-cpu-loras 1 is below --max-loras 2"):
        LoRAManager(manager.slots, max_cpu_loras=1)
    with pytest.raises(ConfigError, match="lora_int_id 0, expected 1 or more"):
        LoRARequest("zero", 0, "x")


def test_an_adapter_outside_the_target_modules_is_refused_naming_its_file_and_module(
    lora_dir: Path, adapters: dict[str, Path]
) -> None:
    limits = LoRALimits(max_loras=1, max_rank=8, max_num_tokens=16, target_modules=("q_proj", "v_proj"))
    manager = LoRAManager(attach_lora(kiln_model(lora_dir / "base"), limits), max_cpu_loras=1)
    manager.add(LoRARequest("qv", 1, str(adapters["qv-r8-rslora"])))  # inside the list: served
    assert manager.step_slots([1]) == [0]
    with pytest.raises(AdapterError) as info:
        manager.add(LoRARequest("kod", 2, str(adapters["kod-r2"])))
    message = str(info.value)
    assert str(adapters["kod-r2"] / "adapter_model.safetensors") in message
    assert re.search(r"adapts (k_proj|o_proj|down_proj) \(model\.layers\.\d+\.", message), message
    assert "outside the engine's LoRA target modules (q_proj, v_proj" in message
    assert list(manager.requests) == [1]
