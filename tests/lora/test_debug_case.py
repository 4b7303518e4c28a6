"""`kiln debug save-case --lora name=path` records the adapter; `check-case` replays it, and refuses by name an adapter
file that is missing or changed since (the case's expectations are the saved adapter's)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import transformers

from kiln.cli import main
from tests.lora.adapters import reference, reference_greedy

PROMPT = [5, 6, 7, 8, 9]
NUM_DECODE = 2
GRAPH = ["--compiler", "eager", "--capture-sizes", "1,2,4,8", "--max-lora-rank", "8"]


@pytest.fixture(scope="module")
def adapter(adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the rank-4 adapter on all seven targets (the tests below change its files)."""
    return Path(shutil.copytree(adapters["all7-r4"], tmp_path_factory.mktemp("case-lora") / "all7"))


@pytest.fixture(scope="module")
def case_dir(base_dir: Path, adapter: Path) -> Path:
    out = adapter.parent / "case"
    run = ["--prompt-ids", ",".join(map(str, PROMPT)), "--num-decode", str(NUM_DECODE), "--out", str(out)]
    assert main(["debug", "save-case", "--model", str(base_dir), *GRAPH, *run, "--lora", f"all7={adapter}"]) == 0
    return out


def test_the_case_records_the_adapter_and_its_tokens(
    case_dir: Path, adapter: Path, hf_base: transformers.PreTrainedModel
) -> None:
    meta = json.loads((case_dir / "case.json").read_text())
    lora = meta["lora"]
    assert lora["name"] == "all7" and lora["path"] == str(adapter.resolve())
    assert lora["rank"] == 4 and lora["max_lora_rank"] == 8
    assert set(lora["sha256"]) == {"adapter_config.json", "adapter_model.safetensors"}
    want, _ = reference_greedy(reference(hf_base, adapter), PROMPT, NUM_DECODE + 1)
    assert meta["expected_tokens"] == want  # saved with the adapter: HF + PEFT's tokens


def test_check_case_replays_the_adapter_and_refuses_a_changed_or_missing_file(
    case_dir: Path, adapter: Path, adapters: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    # the replay runs the adapter: without it every boundary past the embedding would regress
    assert main(["debug", "check-case", str(case_dir)]) == 0
    assert "pass (" in capsys.readouterr().out

    other = adapters["qv-r8-rslora"]
    assert main(["debug", "diff", "--case", str(case_dir), "--lora", f"qv={other}"]) == 1
    err = capsys.readouterr().err
    assert f"--lora qv={other}: the case {case_dir} was saved with LoRA adapter {adapter.resolve()}" in err

    weights = adapter / "adapter_model.safetensors"
    saved = weights.read_bytes()
    shutil.copyfile(other / "adapter_model.safetensors", weights)
    assert main(["debug", "check-case", str(case_dir)]) == 1
    err = capsys.readouterr().err
    assert f"{weights.resolve()} differs from the file LoRA adapter 'all7' had when the case was saved" in err

    weights.write_bytes(saved)
    config = adapter / "adapter_config.json"
    config.rename(adapter / "moved.json")
    assert main(["debug", "check-case", str(case_dir)]) == 1
    assert f"saved with LoRA adapter 'all7' but {config.resolve()} is missing" in capsys.readouterr().err
    (adapter / "moved.json").rename(config)
