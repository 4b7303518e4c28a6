"""`kiln debug diff --lora name=path`: every path (eager, the float64 copy, the graph engine's pieces and full decode
graph) runs the request with the adapter, and the diff holds graph mode to eager for it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from kiln.cli import main
from kiln.debug.commands import lora_request
from kiln.debug.diff import build_reference, run_diff
from kiln.debug.session import EAGER, EAGER_FP64, DebugSession
from kiln.engine.setup.args import EngineArgs
from kiln.errors import ConfigError
from kiln.lora import LoRARequest
from tests.lora.adapters import reference, reference_greedy

PROMPT = [5, 6, 7, 8, 9]
NUM_DECODE = 3
GRAPH = ["--compiler", "eager", "--capture-sizes", "1,2,4,8", "--max-lora-rank", "8"]


def test_diff_with_an_adapter_holds_graph_mode_to_eager(
    base_dir: Path,
    adapters: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["debug", "diff", "--model", str(base_dir), *GRAPH, "--prompt-ids", "5,6,7,8,9", "--json"]
    assert main([*argv, "--lora", f"all7={adapters['all7-r4']}"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["first_divergence"] is None
    assert "layers.3.mlp" in [b["name"] for b in out["boundaries"]]
    assert main([*argv, "--lora", f"all7={adapters['all7-r4']}", "--inject-fault", "layer=1:mlp"]) == 1
    assert json.loads(capsys.readouterr().out)["first_divergence"]["name"] == "layers.1.mlp"


def test_every_path_runs_the_adapter(
    base_dir: Path,
    adapters: dict[str, Path],
    hf_base: transformers.PreTrainedModel,
    tmp_path: Path,
) -> None:
    args = EngineArgs(
        model=str(base_dir),
        compiler="eager",
        capture_sizes=(1, 2, 4, 8),
        max_lora_rank=8,
        cache_dir=str(tmp_path),
    )
    adapter = adapters["all7-r4"]
    session = DebugSession.open(args, lora=LoRARequest("all7", 1, str(adapter)))
    want, _ = reference_greedy(reference(hf_base, adapter), PROMPT, NUM_DECODE + 1)
    base, _ = reference_greedy(reference(hf_base, None), PROMPT, NUM_DECODE + 1)
    assert want != base  # a strong adapter: the tokens below are the adapter's, not the base's
    for path in (EAGER, EAGER_FP64, "captured"):
        assert session.run(path, PROMPT, NUM_DECODE).tokens == want, path
    assert session._eager_engines[EAGER].lora is session.engine.lora  # the same model, the same slots
    assert session._eager_engines[EAGER_FP64].lora is not session.engine.lora  # the copy's own
    report = run_diff(session, build_reference(session, PROMPT, NUM_DECODE), "captured")
    assert report.first_divergence is None


def test_a_bad_lora_spec_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"--lora 'all7': expected NAME=PATH"):
        lora_request("all7")
    assert lora_request("a=/x") == LoRARequest("a", 1, "/x")
    assert lora_request(None) is None
