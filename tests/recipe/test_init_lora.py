"""`kiln recipe init --enable-lora`: a `lora:` section of the flags' sizes and targets, in a recipe that validates
(its memory budget counting the adapters' buffers); a bad target module or a size flag without --enable-lora is
refused naming the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.config import LoRAConfig
from kiln.recipe import load_recipe
from kiln.recipe.cli import main


@pytest.fixture(autouse=True)
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)


def test_init_writes_a_lora_section_that_validates() -> None:
    sizes = ["--max-loras", "4", "--max-lora-rank", "8", "--lora-target-modules", "q_proj,v_proj"]
    assert main(["init", "--enable-lora", *sizes, "--out", "lora.yaml"]) == 0
    recipe = load_recipe("lora.yaml")
    assert recipe.diagnostics == []
    assert recipe.lora == LoRAConfig(enabled=True, max_loras=4, max_lora_rank=8, target_modules=("q_proj", "v_proj"))
    assert main(["validate", "lora.yaml"]) == 0


def test_without_targets_every_layer_and_the_budget_holds_the_buffers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["init", "--enable-lora"]) == 0
    text = capsys.readouterr().out
    assert "target_modules: null  # any of this checkpoint's: q_proj, k_proj, v_proj, o_proj, gate_proj" in text
    Path("default.yaml").write_text(text)
    assert load_recipe("default.yaml").lora == LoRAConfig(enabled=True, max_loras=1, max_lora_rank=16)
    assert main(["init", "--enable-lora", "--lora-dtype", "bfloat16", "--out", "half.yaml"]) == 0
    assert load_recipe("half.yaml").lora == LoRAConfig(enabled=True, dtype="bfloat16")
    # 64 slots of rank 512 on every layer: ~40 GB of buffers, which the budget written must cover
    assert main(["init", "--enable-lora", "--max-loras", "64", "--max-lora-rank", "512", "--out", "big.yaml"]) == 0
    big = load_recipe("big.yaml")
    assert big.diagnostics == [] and big.lora is not None and big.lora.max_loras == 64
    assert "memory_budget_gb: 52}" in Path("big.yaml").read_text()  # ceil(1.25 x (0.54 + 0.75 + 40.0 GB))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-lora-rank", "8"], "kiln recipe init: --max-lora-rank without --enable-lora: add --enable-lora"),
        (["--lora-dtype", "bfloat16"], "kiln recipe init: --lora-dtype without --enable-lora: add --enable-lora"),
        (
            ["--enable-lora", "--lora-target-modules", "q_proj,qkv_proj"],
            "--lora-target-modules: qkv_proj is not a layer of ",
        ),
        (["--enable-lora", "--lora-target-modules", "lm_head"], "--lora-target-modules: lm_head is not a layer kiln"),
    ],
)
def test_bad_lora_flags_are_refused_naming_the_flag(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["init", *flags, "--out", "x.yaml"]) == 1
    assert message in capsys.readouterr().err
    assert not Path("x.yaml").exists()
