"""`kiln recipe validate|init|schema`: compiler-style output and exit codes 0 (valid), 1 (invalid), 2 (usage)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kiln.recipe import load_recipe
from kiln.recipe.cli import main

REPO = Path(__file__).resolve().parents[2]
BOUNDS = "input_constraints:\n  constraints:\n    - num_tokens <= 2048\n    - seq_len <= 2048\n"


def test_validate_valid_recipe(header, write, capsys) -> None:
    assert main(["validate", write(header + BOUNDS)]) == 0
    out = capsys.readouterr().out
    assert "[INFO] Recipe validated: 2 constraints satisfied, 0 conflicts" in out
    assert "[INFO] Witness: num_tokens=" in out


def test_validate_invalid_recipe_prints_file_line_col(header, write, capsys) -> None:
    path = write(header + BOUNDS + "    - seq_len >= 4096\n")
    assert main(["validate", path]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[:3] == [
        "recipe.yaml:7:7: error: seq_len <= 2048 (line 7) conflicts with seq_len >= 4096 (line 8)",
        "    - seq_len <= 2048",
        "      ^~~~~~~~~~~~~~~",
    ]
    assert err[-1] == "1 error, 0 warnings"


def test_validate_warnings_still_exit_zero(header, write, capsys) -> None:
    assert main(["validate", write(header + BOUNDS + "    - seq_len <= 4096\n")]) == 0
    assert "recipe.yaml:8:7: warning: redundant constraint seq_len <= 4096" in capsys.readouterr().err


def test_validate_json(header, write, capsys) -> None:
    assert main(["validate", write(header + BOUNDS + "    - batch_size % 4 = 0\n"), "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["valid"] is False
    (d,) = result["diagnostics"]
    assert (d["file"], d["line"], d["col"], d["severity"]) == ("recipe.yaml", 8, 22, "error")


def test_usage_errors_exit_two(capsys) -> None:
    assert main(["validate", "does-not-exist.yaml"]) == 2
    assert "no such file: does-not-exist.yaml" in capsys.readouterr().err
    assert main(["frobnicate"]) == 2
    assert main([]) == 2


def test_model_override(header, write, capsys, tmp_path) -> None:
    assert main(["validate", write(header + BOUNDS), "--model", str(tmp_path / "absent.gguf")]) == 1
    assert "recipe.yaml:2:44: error: --model: cannot read the checkpoint" in capsys.readouterr().err


def test_init_writes_a_recipe_that_validates(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["init", "--model", "default"]) == 0
    text = capsys.readouterr().out
    Path("stdout.yaml").write_text(text)
    assert load_recipe("stdout.yaml").diagnostics == []
    assert main(["init", "--out", "sub.yaml"]) == 0
    assert Path("sub.yaml").read_text() == text.replace("validate recipe.yaml", "validate sub.yaml")
    assert main(["validate", "sub.yaml"]) == 0


def test_init_with_a_model_path_writes_a_path_relative_to_the_output(tmp_path, monkeypatch) -> None:
    from kiln.model.loader import default_model_path

    model = default_model_path()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").mkdir()
    assert main(["init", "--model", model, "--out", "recipes/m.yaml"]) == 0
    relative = os.path.relpath(model, tmp_path / "recipes")
    assert f'path: "{relative}"' in Path("recipes/m.yaml").read_text()
    assert load_recipe("recipes/m.yaml").model_path == model


def test_init_bad_model_fails(tmp_path, capsys) -> None:
    assert main(["init", "--model", str(tmp_path / "nope.gguf")]) == 1
    assert "kiln recipe init: " in capsys.readouterr().err


def test_module_entry_point() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "kiln.recipe.cli", "validate", "recipes/errors/conflict.yaml"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 1
    assert run.stderr.startswith("recipes/errors/conflict.yaml:9:7: error: seq_len <= 2048 (line 9) conflicts with")
