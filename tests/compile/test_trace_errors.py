"""A forward that cannot be traced fails with the module path and the op, not a dynamo traceback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.compile.artifacts import write_trace_failure
from kiln.compile.diagnose import GraphTraceError
from tests.compile.tiny import graph_runner, tiny_model


@torch.library.custom_op("kiln_test::no_fake", mutates_args=())
def no_fake(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


class CallsGetpid(nn.Module):
    """An MLP that calls a C function dynamo cannot trace (a graph break)."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.inner = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        os.getpid()
        return self.inner(x)


class CallsOpWithoutFake(CallsGetpid):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(torch.ops.kiln_test.no_fake(x))


@pytest.mark.parametrize(
    ("wrapper", "op"), [(CallsGetpid, "getpid"), (CallsOpWithoutFake, "kiln_test.no_fake")], ids=["break", "no-fake"]
)
def test_untraceable_module_is_named(wrapper: type[nn.Module], op: str, cache_dir: Path, tmp_path: Path) -> None:
    model = tiny_model(num_layers=3)
    model.model.layers[1].mlp = wrapper(model.model.layers[1].mlp)
    with pytest.raises(GraphTraceError) as info:
        graph_runner(model, cache_dir, compiler="eager")
    err = info.value
    assert err.module_path.startswith("model.layers.1.mlp"), err.module_path
    assert op in err.op
    assert "test_trace_errors.py" in err.location
    message = str(err)
    assert "model.layers.1.mlp" in message and op in message and "graph trace failed" in message
    write_trace_failure(err, tmp_path / "dump")
    lint = (tmp_path / "dump" / "lint.txt").read_text()
    assert "graph breaks: 1" in lint and "model.layers.1.mlp" in lint
