"""diff finds the first bad boundary and bisect the piece holding it, for faults the tests inject themselves."""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import pytest

from kiln.cli import main
from kiln.compile.modes import PieceMode
from kiln.debug.bisect import Bisector, BisectResult
from kiln.debug.diff import DiffReport, Reference, build_reference, run_diff
from kiln.debug.faults import inject, parse_fault
from kiln.debug.session import DebugSession
from kiln.errors import ConfigError
from tests.debug.conftest import NUM_DECODE, PROMPT, TINY, tiny_options
from tests.debug.models import NUM_LAYERS

NUM_PIECES = NUM_LAYERS + 1


def round_budget(num_culprits: int) -> int:
    """All captured + all eager, then per culprit a binary search and a check alone, then one compiled round."""
    return 2 + num_culprits * (math.ceil(math.log2(NUM_PIECES)) + 1) + 1


def diff_and_bisect(session: DebugSession, reference: Reference) -> tuple[DiffReport, BisectResult]:
    report = run_diff(session, reference, "captured")

    def fails(modes: dict[int, PieceMode]) -> bool:
        return run_diff(session, reference, "captured", piece_modes=modes).first_divergence is not None

    return report, Bisector(len(session.graph.pieces), fails, log=lambda _line: None).run()


def test_no_fault_no_divergence_and_nothing_to_bisect(
    open_tiny: Callable[..., DebugSession], tiny_reference: Reference
) -> None:
    session = open_tiny()
    for mode in ("traced", "compiled", "captured"):
        report = run_diff(session, tiny_reference, mode)
        assert report.first_divergence is None, (mode, report.first_divergence)
        assert report.first_token_mismatch is None
    report, result = diff_and_bisect(session, tiny_reference)
    assert result.culprits == [] and len(result.rounds) == 1
    assert "nothing to bisect" in result.verdict


@pytest.mark.parametrize(("layer", "part"), [(0, "mlp"), (1, "attn"), (2, "mlp"), (NUM_LAYERS - 1, "mlp")])
def test_layer_fault_is_the_first_divergence_and_bisect_finds_its_piece(
    layer: int, part: str, open_tiny: Callable[..., DebugSession], tiny_reference: Reference
) -> None:
    session = open_tiny()
    inject(session, parse_fault(f"layer={layer}:{part}"))
    report, result = diff_and_bisect(session, tiny_reference)
    first = report.first_divergence
    assert first is not None
    assert first.name == f"layers.{layer}.{part}" and first.piece == layer + 1
    assert result.culprits == [layer + 1]
    assert result.fails_compiled is True  # a miscompile: it fails compiled as well as captured
    assert len(result.rounds) <= round_budget(1), [str(r) for r in result.rounds]


@pytest.mark.parametrize(("scale", "layer", "part"), [(1e-3, 1, "mlp"), (1e-4, 2, "attn"), (1e-5, 0, "mlp")])
def test_a_small_fault_is_found_in_its_layer_and_piece(
    scale: float, layer: int, part: str, open_tiny: Callable[..., DebugSession], tiny_reference: Reference
) -> None:
    """The debugger's sensitivity: a fault of 1e-5 in one module is above its boundary's threshold (fp32 rounding,
    ~1e-7, times the noise ratio), and neither an earlier boundary nor another piece is blamed for it."""
    session = open_tiny()
    inject(session, parse_fault(f"layer={layer}:{part}"), scale=scale)
    first = run_diff(session, tiny_reference, "captured").first_divergence
    assert first is not None, f"a {scale:g} fault in layers.{layer}.{part} went unseen"
    assert first.name == f"layers.{layer}.{part}" and first.piece == layer + 1


@pytest.mark.parametrize("piece", [0, 3])
def test_stale_input_is_found_as_a_capture_fault(
    piece: int, open_tiny: Callable[..., DebugSession], tiny_reference: Reference
) -> None:
    session = open_tiny(graph_mode="piecewise")  # decode steps replay the pieces' captures, where the fault is
    inject(session, parse_fault(f"piece={piece}:stale-input"))
    report, result = diff_and_bisect(session, tiny_reference)
    first = report.first_divergence
    assert first is not None and first.piece == piece
    assert first.max_at["step"] >= 2  # the first replay at a size saw fresh input; later decodes read it again
    assert result.culprits == [piece]
    assert result.fails_compiled is False  # only the captured replay is wrong
    assert len(result.rounds) <= round_budget(1)


def test_diff_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["debug", "diff", "--model", TINY, "--compiler", "eager", "--capture-sizes", "1,2,4,8", "--json"]
    assert main([*argv, "--prompt-ids", "5,6,7,8,9"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["first_divergence"] is None
    assert [b["name"] for b in out["boundaries"]][:3] == ["embed", "layers.0.attn", "layers.0.mlp"]
    assert {"max_abs", "max_rel", "rel_diff", "cosine", "max_at", "noise", "threshold"} <= set(out["boundaries"][0])
    assert main([*argv, "--inject-fault", "layer=2:mlp"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["first_divergence"]["name"] == "layers.2.mlp"
    assert out["first_divergence"]["module"] == "model.layers.2.mlp"


def test_diff_and_bisect_with_speculation_hold_the_verification_steps(
    open_tiny: Callable[..., DebugSession], tiny_reference: Reference
) -> None:
    """With speculative decoding every path verifies the reference's tokens as drafts: the steps of k + 1 rows (the
    verification graphs) are held to the eager reference row by row, and a fault in them is found and bisected."""
    spec = dict(speculative_method="ngram", num_speculative_tokens=2)
    reference = build_reference(open_tiny(**spec), PROMPT, NUM_DECODE)
    assert reference.tokens == tiny_reference.tokens  # greedy: the same tokens with drafts as without
    assert reference.step_rows == [len(PROMPT), 3, 1] and reference.logit_rows == [1, 3, 1]  # 2 drafts + own
    session = open_tiny(**spec)
    for mode in ("traced", "captured"):
        report = run_diff(session, reference, mode)
        assert report.first_divergence is None and report.first_token_mismatch is None, mode
    inject(session, parse_fault("layer=1:attn"))
    report, result = diff_and_bisect(session, reference)
    assert report.first_divergence is not None and report.first_divergence.name == "layers.1.attn"
    assert result.culprits == [2]


def test_diff_over_a_cached_prefix_prefills_the_rest_and_finds_a_fault(open_tiny: Callable[..., DebugSession]) -> None:
    """--cached-prefix: every path's prefill finds the prompt's first blocks in the prefix cache (primed by an
    earlier request) and computes the rest over that context; held to the reference, a fault there is found."""
    prompt = (PROMPT * 3)[:21]
    block = tiny_options().block_size
    session = DebugSession.open(tiny_options(), cached_prefix=block)
    reference = build_reference(session, prompt, NUM_DECODE)
    assert reference.step_rows[0] == len(prompt) - block and reference.positions[0] == block  # the tail alone
    assert reference.tokens == build_reference(open_tiny(), prompt, NUM_DECODE).tokens  # as over the whole prompt
    for mode in ("traced", "captured"):
        assert run_diff(session, reference, mode).first_divergence is None, mode
    inject(session, parse_fault("layer=2:mlp"))
    report = run_diff(session, reference, "captured")
    assert report.first_divergence is not None and report.first_divergence.name == "layers.2.mlp"
    with pytest.raises(ConfigError, match="multiple of the KV block size"):
        build_reference(DebugSession.open(tiny_options(), cached_prefix=block - 1), prompt, NUM_DECODE)
