"""Synthetic models for the debugger's tests, loadable as `--model tests.debug.models:NAME`."""

from __future__ import annotations

import os

import torch
from torch import nn

from kiln.model.llama import LlamaForCausalLM
from tests.compile.tiny import tiny_model

NUM_LAYERS = 4


def tiny_llama() -> LlamaForCausalLM:
    """A random 4-layer Llama (hidden 64, vocab 128): 5 graph pieces."""
    return tiny_model(num_layers=NUM_LAYERS)


@torch.library.custom_op("kiln_debug_test::scale_no_fake", mutates_args=())
def scale_no_fake(x: torch.Tensor) -> torch.Tensor:
    """A custom op registered without a fake implementation: dynamo cannot trace through it."""
    return x * 1.0


class GetpidMLP(nn.Module):
    """An MLP that calls a C function dynamo does not know (a graph break)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        os.getpid()
        return self.inner(x)


class NoFakeMLP(GetpidMLP):
    """An MLP that calls an op without a fake implementation (a trace failure)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(torch.ops.kiln_debug_test.scale_no_fake(x))


def tiny_llama_unregistered_op() -> LlamaForCausalLM:
    """tiny_llama with layer 2's MLP calling an op that has no fake implementation."""
    model = tiny_llama()
    model.model.layers[2].mlp = NoFakeMLP(model.model.layers[2].mlp)
    return model


def tiny_llama_graph_break() -> LlamaForCausalLM:
    """tiny_llama with a graph break in layer 1's MLP and an op without a fake in layer 2's."""
    model = tiny_llama_unregistered_op()
    model.model.layers[1].mlp = GetpidMLP(model.model.layers[1].mlp)
    return model
