"""Saved debug cases replay as regression checks: from the CLI and collected by pytest."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from kiln.cli import main
from tests.debug.conftest import TINY

FLAGS = ["--model", TINY, "--compiler", "eager", "--capture-sizes", "1,2,4,8"]


@pytest.fixture(scope="module")
def case_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cases") / "tiny-greedy"
    args = ["--prompt-ids", "9,8,7,6,5,4", "--num-decode", "3", "--out", str(out)]
    assert main(["debug", "save-case", *FLAGS, *args]) == 0
    return out


def test_case_holds_inputs_expectations_thresholds_and_fingerprint(case_dir: Path) -> None:
    meta = json.loads((case_dir / "case.json").read_text())
    assert meta["model"] == TINY and meta["prompt_ids"] == [9, 8, 7, 6, 5, 4] and meta["num_decode"] == 3
    assert meta["sampling"]["temperature"] == 0.0 and meta["seed"] == 0 and len(meta["expected_tokens"]) == 4
    assert {"torch", "device", "recipe_hash", "kiln"} <= set(meta["fingerprint"])
    first = meta["boundaries"][0]
    assert first["name"] == "embed" and {"noise", "threshold", "at_save"} <= set(first)
    tensors = load_file(str(case_dir / "tensors.safetensors"))
    assert tensors["input_ids"].tolist()[:6] == [9, 8, 7, 6, 5, 4]
    assert tensors["positions"].tolist() == list(range(9))
    assert tensors["boundary.logits"].shape == (4, 128) and tensors["boundary.layers.3.mlp"].shape == (9, 64)


def test_check_case_passes_then_names_the_regressed_boundary(
    case_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["debug", "check-case", str(case_dir)]) == 0
    assert "pass (11 boundaries within their thresholds)" in capsys.readouterr().out
    assert main(["debug", "check-case", str(case_dir), "--inject-fault", "layer=1:mlp"]) == 1
    err = capsys.readouterr().err
    assert "REGRESSION at boundary layers.1.mlp (model.layers.1.mlp, piece 2)" in err


def test_bisect_on_a_case(case_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["debug", "bisect", "--case", str(case_dir), "--inject-fault", "piece=4:stale-input"]) == 0
    out = capsys.readouterr().out
    assert "Culprit: piece 4 (" in out and "fail only when captured" in out


def test_pytest_collects_cases(case_dir: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    plugins = ["-p", "kiln.debug.pytest_plugin", "-p", "no:cacheprovider"]
    cmd = [sys.executable, "-m", "pytest", "-q", *plugins, str(case_dir)]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout
