"""The debugger on the default model (SmolLM2-135M, 30 layers, 31 pieces) with its recipe, eager compiler."""

from __future__ import annotations

import json

import pytest

from kiln.cli import main
from kiln.debug.diff import Reference, build_reference, run_diff
from kiln.debug.faults import inject, parse_fault
from kiln.debug.session import DebugSession
from kiln.engine.setup.args import EngineArgs

RECIPE = "recipes/smollm2-135m.yaml"
FAULT_LAYER = 17


@pytest.fixture(scope="module")
def session() -> DebugSession:
    return DebugSession.open(EngineArgs(recipe=RECIPE, compiler="eager", capture_sizes=(1, 8)))


@pytest.fixture(scope="module")
def reference(session: DebugSession) -> Reference:
    prompt = session.tokenizer.encode("The capital of France is")
    return build_reference(session, prompt, num_decode=3)


def test_no_fault_no_divergence(session: DebugSession, reference: Reference) -> None:
    assert len(session.graph.pieces) == 31 and session.recipe is not None
    report = run_diff(session, reference, "captured")
    assert report.first_divergence is None, report.first_divergence
    assert report.first_token_mismatch is None
    assert len(report.boundaries) == 2 * 30 + 3


def test_layer_fault_is_the_first_divergence(session: DebugSession, reference: Reference) -> None:
    inject(session, parse_fault(f"layer={FAULT_LAYER}:mlp"))  # last test of the module: the session stays faulty
    report = run_diff(session, reference, "captured")
    first = report.first_divergence
    assert first is not None
    assert (first.name, first.module, first.piece) == (
        f"layers.{FAULT_LAYER}.mlp",
        f"model.layers.{FAULT_LAYER}.mlp",
        FAULT_LAYER + 1,
    )
    earlier = [b for b in report.boundaries if b.piece is not None and b.piece <= FAULT_LAYER]
    assert earlier and not any(b.diverged for b in earlier)


@pytest.mark.timeout(1800)  # the default model traced and run per layer twice: over 10 min on a slow 2-core box
def test_diff_over_a_200_token_prompt(capsys: pytest.CaptureFixture[str]) -> None:
    """The debug engine's KV pool comes from the runner's named geometry (it once read the head count: 48 tokens)."""
    prompt = ",".join(str(t) for t in range(1000, 1200))
    argv = ["debug", "diff", "--recipe", RECIPE, "--compiler", "eager", "--capture-sizes", "1,8"]
    code = main([*argv, "--prompt-ids", prompt, "--num-decode", "2", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["first_divergence"] is None
    assert len(report["reference_tokens"]) == len(report["test_tokens"]) == 3 and report["first_token_mismatch"] is None
    assert len(report["boundaries"]) == 2 * 30 + 3
