"""What makes the packed kernel table's timing cheap: slow candidates leave the race, a graph compiles once."""

from __future__ import annotations

import pytest
import torch
from torch.fx import GraphModule

import kiln.kernels.packed as packed
from kiln.compile.compiler import CompiledPiece, CompileOnce, EagerCompiler
from kiln.kernels.product import Compiled, trace_static
from kiln.quant.ops import dequantize_codes


def test_candidates_far_behind_after_a_round_sit_out_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    """Times are given (no clock): `slow` is 10x the lead after round 1 and is not timed again; `close` (1.5x)
    stays for every round; each keeps its best sweep and the winner is the fastest."""
    given = {"fast": [10.0, 9.0, 11.0], "close": [15.0, 14.0, 16.0], "slow": [100.0, 1.0, 1.0]}
    sweeps: dict[str, int] = dict.fromkeys(given, 0)

    def fake_time_us(kernel, x, copies) -> float:
        name = kernel.name
        us = given[name][sweeps[name]]
        sweeps[name] += 1
        return us

    class Named:
        def __init__(self, name: str) -> None:
            self.name = name

        def __call__(self, x, *weight) -> None:  # the warm-up call
            pass

    monkeypatch.setattr(packed, "time_us", fake_time_us)
    times = packed.time_candidates({n: Named(n) for n in given}, torch.zeros(1, 4), [()], rounds=3)
    assert sweeps == {"fast": 3, "close": 3, "slow": 1}
    assert times == {"fast": 9.0, "close": 14.0, "slow": 100.0}  # had slow run again, its 1.0 would have won
    assert min(times, key=times.__getitem__) == "fast"


class CountingCompiler(EagerCompiler):
    def __init__(self) -> None:
        self.calls: list[int | None] = []

    def compile(self, graph: GraphModule, static_size: int | None = None) -> CompiledPiece:
        self.calls.append(static_size)
        return CompiledPiece(graph.forward, None)


def test_compile_once_compiles_each_structure_and_size_once_and_computes_the_same() -> None:
    inner = CountingCompiler()
    once = CompileOnce(inner)
    codes = torch.randint(0, 255, (8, 2, 16), dtype=torch.uint8)
    scale, offset = torch.rand(8, 2, 1), torch.rand(8, 2, 1)
    kernels = [Compiled(dequantize_codes, once, None, codes, scale, offset) for _ in range(3)]
    assert inner.calls == [None]  # three traces of one graph: one compile
    other = torch.randint(0, 255, (4, 2, 16), dtype=torch.uint8)  # another shape is another structure
    Compiled(dequantize_codes, once, None, other, scale[:4], offset[:4])
    assert inner.calls == [None, None]
    graph = trace_static(lambda a: (a * 2,), torch.ones(3))
    once.compile(graph, None), once.compile(graph, None)
    assert inner.calls == [None, None, None]
    want = dequantize_codes(codes, scale, offset)
    for kernel in kernels:
        torch.testing.assert_close(kernel(codes, scale, offset), want, rtol=0, atol=0)
