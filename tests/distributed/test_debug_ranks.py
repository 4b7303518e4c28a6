"""`kiln debug diff` and `bisect` per rank: each rank of a 2-process engine (gloo) debugs its own shard.

A tiny random Llama (2 layers) with a fault built into one layer's compiled code: at TP=2 both ranks run that
layer (on their slices) and both name it as the first divergence; at PP=2 the stage holding it names it, the other
stage sees only the logits move, and the summary names the stage. Bisection finds the culprit piece on the
stage that holds it and reports the same index clean on the other.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.cli import main
from tests.engine.tiny_models import write_hf_model

COMMON = ["--quantization", "none", "--prompt-ids", "5,17,42,7", "--num-decode", "2", "--capture-sizes", "1,2"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    write_hf_model(path, "llama", perturb=0.05)
    return path


def debug(tiny: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "kiln.cli", "debug", *args, "--model", str(tiny), *COMMON]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result


def rank_sections(result: subprocess.CompletedProcess[str]) -> list[str]:
    """The report of each of the 2 ranks, in rank order (the command's stderr when it printed none)."""
    sections = result.stdout.split("== rank ")[1:]
    assert len(sections) == 2, result.stderr[-3000:]
    return sections


def test_tensor_parallel_ranks_both_find_the_fault(tiny: Path) -> None:
    result = debug(tiny, "diff", "--tensor-parallel-size", "2", "--inject-fault", "layer=1:mlp")
    assert result.returncode == 1, result.stderr[-3000:]
    ranks = rank_sections(result)
    assert [r.splitlines()[0] for r in ranks] == [
        "0: tensor slice 0 of 2, pipeline stage 0 of 1 ==",
        "1: tensor slice 1 of 2, pipeline stage 0 of 1 ==",
    ]
    for report in ranks:  # the first boundary past the tolerance is the faulty one, on both slices
        diverged = [line.split()[0] for line in report.splitlines() if line.endswith("<-- DIVERGED")]
        assert diverged[0] == "layers.1.mlp" and "First divergence: layers.1.mlp" in report
    assert "First divergence across ranks: layers.1.mlp on rank 0 (pipeline stage 0)" in result.stdout


def test_a_clean_tensor_parallel_diff_passes(tiny: Path) -> None:
    result = debug(tiny, "diff", "--tensor-parallel-size", "2", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = json.loads(result.stdout)
    assert [(r["rank"], r["tensor_rank"]) for r in ranks] == [(0, 0), (1, 1)]
    assert all(r["report"]["first_divergence"] is None for r in ranks)


def test_pipeline_stages_name_the_stage_holding_the_fault(tiny: Path) -> None:
    result = debug(tiny, "diff", "--pipeline-parallel-size", "2", "--inject-fault", "layer=1:mlp")
    assert result.returncode == 1, result.stderr[-3000:]
    stage0, stage1 = rank_sections(result)
    assert "layers.1." not in stage0 and "layers.0.mlp" in stage0  # each stage taps its own layers
    assert "First divergence: logits" in stage0  # its own layers are clean; the logits come from stage 1
    assert "layers.0." not in stage1 and "First divergence: layers.1.mlp" in stage1
    assert "First divergence across ranks: layers.1.mlp on rank 1 (pipeline stage 1)" in result.stdout
    assert "layer 1 runs on another pipeline stage: nothing injected on this rank" in result.stderr


def test_pipeline_bisect_finds_the_piece_on_its_stage(tiny: Path) -> None:
    result = debug(tiny, "bisect", "--pipeline-parallel-size", "2", "--inject-fault", "layer=1:mlp")
    assert result.returncode == 0, result.stderr[-3000:]
    stage0, stage1 = rank_sections(result)
    assert "Culprit:" not in stage0 and "Clean on this rank: piece" in stage0
    assert "Culprit: piece" in stage1 and "model.layers.1.mlp" in stage1
    assert stage0.count("Bisect done in") == stage1.count("Bisect done in") == 1


def test_cases_stay_single_device_with_one_line(tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Refused before any rank starts or any model loads: run in this process (`kiln.cli.main`, as the command)."""

    def refusal(*args: str) -> str:
        capsys.readouterr()
        assert main(["debug", *args, "--model", str(tiny), *COMMON, "--tensor-parallel-size", "2"]) == 1
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("kiln: error: "), lines
        return lines[0]

    assert "diff and bisect start the ranks themselves" in refusal("save-case", "--out", str(tmp_path / "case"))
    assert "--case and --check are single-device" in refusal("diff", "--case", str(tmp_path / "missing"))
