"""LoRA adapters are not sharded yet: `--enable-lora` with a tensor- or pipeline-parallel layout is refused when the
config is resolved (before any model loads or rank starts), naming the layout found and what to drop; an engine
config built directly is refused the same way when the adapters would be attached."""

from __future__ import annotations

import pytest
from torch import nn

from kiln.config import EngineConfig, LoRAConfig, ParallelConfig
from kiln.engine.setup.args import EngineArgs
from kiln.engine.setup.build import lora_manager
from kiln.engine.setup.resolve import resolve_engine_config
from kiln.errors import ConfigError

EXPECTED = "--enable-lora: LoRA adapters run on one device for now (tensor and pipeline parallel size 1), but the "


@pytest.mark.parametrize(("tensor", "pipeline"), [(2, 1), (1, 2)])
def test_lora_with_a_parallel_layout_is_refused_naming_it(tensor: int, pipeline: int) -> None:
    args = EngineArgs(enable_lora=True, tensor_parallel_size=tensor, pipeline_parallel_size=pipeline)
    with pytest.raises(ConfigError) as info:
        resolve_engine_config(args)
    message = str(info.value)
    assert message.startswith(EXPECTED), message
    layout = f"engine is laid out over 2 devices (--tensor-parallel-size {tensor}, --pipeline-parallel-size {pipeline})"
    assert layout in message
    assert message.endswith("drop --enable-lora (or the recipe's lora: section) or the parallel layout")
    resolve_engine_config(EngineArgs(tensor_parallel_size=tensor, pipeline_parallel_size=pipeline))  # no LoRA: fine


def test_a_config_built_directly_is_refused_before_the_adapters_attach() -> None:
    config = EngineConfig(lora=LoRAConfig(enabled=True), parallel=ParallelConfig(tensor=2))
    with pytest.raises(ConfigError, match=r"^--enable-lora: LoRA adapters run on one device for now"):
        lora_manager(config, nn.Linear(2, 2))
    assert lora_manager(EngineConfig(parallel=ParallelConfig(tensor=2)), nn.Linear(2, 2)) is None
