"""The bisection itself, on synthetic checks: culprit sets found within about log2(N) rounds per piece."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from kiln.cli import main
from kiln.compile.modes import PieceMode
from kiln.debug.bisect import Bisector, format_indices

CHECK_SCRIPT = Path(__file__).with_name("check_modes.py")


def check_for(culprits: set[int], needs: PieceMode = PieceMode.CAPTURED):
    levels = {PieceMode.EAGER: 0, PieceMode.COMPILED: 1, PieceMode.CAPTURED: 2}

    def fails(modes: dict[int, PieceMode]) -> bool:
        return all(levels[modes[i]] >= levels[needs] for i in culprits)

    return fails


@pytest.mark.parametrize("num_pieces", [5, 31])
@pytest.mark.parametrize("culprits", [{0}, {7}, {30}, {3, 20}, {0, 30}, {4, 5, 6}])
def test_finds_the_minimal_set(num_pieces: int, culprits: set[int]) -> None:
    if max(culprits) >= num_pieces:
        culprits = {c % num_pieces for c in culprits}
    result = Bisector(num_pieces, check_for(culprits), log=lambda _line: None).run()
    assert set(result.culprits) == culprits
    budget = 2 + len(culprits) * (math.ceil(math.log2(num_pieces)) + 1) + 1
    assert len(result.rounds) <= budget


def test_tells_miscompile_from_capture_fault() -> None:
    assert Bisector(9, check_for({4}, PieceMode.COMPILED), log=lambda _l: None).run().fails_compiled is True
    assert Bisector(9, check_for({4}, PieceMode.CAPTURED), log=lambda _l: None).run().fails_compiled is False


def test_no_failure_and_eager_failure_stop_early() -> None:
    assert Bisector(9, lambda _m: False, log=lambda _l: None).run().culprits == []
    result = Bisector(9, lambda _m: True, log=lambda _l: None).run()
    assert result.culprits == [] and "not in graph mode" in result.verdict


def test_rounds_are_printed() -> None:
    lines: list[str] = []
    Bisector(16, check_for({11}), log=lines.append).run()
    assert lines[0] == "Bisect round 1: pieces 0-15 captured → FAIL"
    assert lines[1] == "Bisect round 2: pieces none captured → pass"
    assert lines[2] == "Bisect round 3: pieces 0-7 captured → pass"
    assert format_indices([0, 1, 2, 3, 9, 11, 12]) == "0-3,9,11-12"


def test_check_command_gets_the_piece_modes(capsys: pytest.CaptureFixture[str]) -> None:
    check = f"{sys.executable} {CHECK_SCRIPT} 3 {{piece_modes}}"
    argv = ["debug", "bisect", "--model", "tests.debug.models:tiny_llama", "--compiler", "eager", "--check", check]
    assert main([*argv, "--capture-sizes", "1,8"]) == 0
    out = capsys.readouterr().out
    assert "Bisect round 1: pieces 0-4 captured → FAIL" in out
    assert "Culprit: piece 3 (model.layers.2.self_attn.o_proj .. model.layers.3.self_attn.rotary_emb)" in out
    assert "ops: " in out and "model.layers.2.mlp" in out
    assert "fail only when captured" in out
