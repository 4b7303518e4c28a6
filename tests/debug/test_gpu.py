"""The debugger on CUDA: taps out of real CUDA graphs, faults found, replay addresses checked (needs a GPU)."""

from __future__ import annotations

import pytest
import torch

from kiln.compile.capture import CaptureAddressError, CudaGraphCapture
from kiln.debug.bisect import Bisector
from kiln.debug.diff import Reference, build_reference, run_diff
from kiln.debug.faults import inject, parse_fault
from kiln.debug.session import DebugSession
from tests.debug.conftest import NUM_DECODE, PROMPT, tiny_options

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def bisect(session: DebugSession, reference: Reference) -> list[int]:
    def fails(modes: dict) -> bool:
        return run_diff(session, reference, "captured", piece_modes=modes).first_divergence is not None

    return Bisector(len(session.graph.pieces), fails, log=print).run().culprits


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_cuda_graph_taps_and_faults(compiler: str) -> None:
    session = DebugSession.open(tiny_options(device="cuda", compiler=compiler))
    reference = build_reference(session, PROMPT, NUM_DECODE)
    report = run_diff(session, reference, "captured")
    assert all(isinstance(c, CudaGraphCapture) for p in session.graph.pieces for c in p.captures.values())
    assert report.first_divergence is None, report.first_divergence
    inject(session, parse_fault("layer=2:mlp"))
    first = run_diff(session, reference, "captured").first_divergence
    assert first is not None and first.name == "layers.2.mlp"
    assert bisect(session, reference) == [3]


def test_cuda_stale_input_and_address_check(monkeypatch: pytest.MonkeyPatch) -> None:
    session = DebugSession.open(tiny_options(device="cuda"))
    reference = build_reference(session, PROMPT, NUM_DECODE)
    inject(session, parse_fault("piece=1:stale-input"))
    assert bisect(session, reference) == [1]

    monkeypatch.setenv("KILN_DEBUG", "1")
    # piecewise: decode steps replay piece 2's size-1 capture (a full decode graph would run them instead)
    traced = DebugSession.open(tiny_options(device="cuda", graph_mode="piecewise"))
    traced.set_modes("captured")
    capture = traced.graph.pieces[2].captures[1]
    i, buf = capture.inputs[0]
    capture.inputs[0] = (i, buf.clone())
    with pytest.raises(CaptureAddressError, match="stale data"):
        traced.run("captured", PROMPT, NUM_DECODE)
