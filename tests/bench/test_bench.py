"""`kiln bench`: rates and ratios from timings, the graph-mode hook, and small end-to-end runs on the default model."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

import kiln.cli as kiln_cli
from kiln.bench.metrics import RunResult, compute_ratios, random_prompts
from kiln.bench.modes import engine_args_for_mode
from kiln.bench.report import print_report
from kiln.engine.setup.args import EngineArgs
from kiln.errors import ConfigError

SMALL = ["--num-requests", "2", "--num-requests-bs1", "1", "--input-len", "8", "--output-len", "4"]
SMALL += ["--batch-sizes", "1,2", "--num-kv-blocks", "64", "--modes", "eager"]


def _run(system: str, mode: str, batch_size: int, wall_s: float) -> RunResult:
    return RunResult(system, mode, batch_size, 8, 4, wall_s, 0.5, [0.1, 0.3], [0.2, 0.2], [[1, 2, 3, 4]] * 2)


def test_rates_follow_from_timings() -> None:
    run = _run("kiln", "eager", 2, wall_s=2.0)
    row = run.to_row()
    assert row["output_tok_s"] == pytest.approx(4.0)  # 2 requests x 4 tokens / 2 s
    assert row["prefill_tok_s"] == pytest.approx(32.0)  # 2 x 8 prompt tokens / 0.5 s
    assert row["decode_tok_s_per_seq"] == pytest.approx(5.0)
    assert row["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert row["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert row["ttft_ms"]["p90"] == pytest.approx(280.0)


def test_ratios_compare_kiln_with_hf_and_modes_with_eager() -> None:
    runs = [_run("kiln", "eager", 1, 2.0), _run("kiln", "piecewise", 1, 1.0), _run("hf", "eager", 1, 4.0)]
    ratios = compute_ratios(runs)
    assert ratios["eager/hf"]["1"]["output_tok_s"] == pytest.approx(2.0)
    assert ratios["piecewise/hf"]["best"] == pytest.approx(4.0)
    assert ratios["piecewise/eager"]["1"]["output_tok_s"] == pytest.approx(2.0)
    assert "eager/eager" not in ratios


def test_random_prompts_are_seeded_and_exact_length() -> None:
    a = random_prompts(3, 5, 100, seed=7)
    assert a == random_prompts(3, 5, 100, seed=7) != random_prompts(3, 5, 100, seed=8)
    assert all(len(p) == 5 and all(0 <= t < 100 for t in p) for p in a)


def test_each_mode_sets_its_graph_flags_over_the_users() -> None:
    args = kiln_cli.build_parser().parse_args(["bench", "--enable-piecewise-graph", "--compiler", "eager"])
    eager = engine_args_for_mode(args, "eager")
    # eager stays eager beside the flags, which act in the bench's other modes (the bench does not refuse them there)
    assert not eager.create_engine_config(refuse_inert_options=False).graph_mode.is_graph
    with pytest.raises(ConfigError, match="--compiler does nothing under graph mode eager"):
        eager.create_engine_config()  # an eager engine alone: the flag would do nothing
    for mode in ("piecewise", "full", "full_and_piecewise", "full_decode_only"):
        engine = engine_args_for_mode(args, mode)
        config = engine.create_engine_config()
        assert config.graph_mode.is_graph and config.graph.mode == mode
        assert engine.compiler == "eager"  # the other flags are kept
    assert not engine_args_for_mode(args, "full").create_engine_config().graph.mode.splits_forward


def test_graph_mode_flags() -> None:
    parser = kiln_cli.build_parser()
    default = EngineArgs.from_cli_args(parser.parse_args(["serve", "--enable-piecewise-graph"]))
    assert default.create_engine_config().graph.mode == "full_and_piecewise"
    alias = EngineArgs.from_cli_args(parser.parse_args(["serve", "--full-graph"])).create_engine_config()
    assert alias.graph_mode.is_graph and alias.graph.mode == "full"
    named = EngineArgs.from_cli_args(parser.parse_args(["serve", "--graph-mode", "piecewise"])).create_engine_config()
    assert named.graph_mode.is_graph and named.graph.mode == "piecewise" and not named.graph.mode.has_full_decode_graph
    plain = EngineArgs.from_cli_args(parser.parse_args(["serve"])).create_engine_config()
    assert plain.graph.mode == "full_and_piecewise" and plain.executor == "graph"  # graph mode by default
    for argv in (["--graph-mode", "eager"], ["--enforce-eager"]):
        eager = EngineArgs.from_cli_args(parser.parse_args(["serve", *argv])).create_engine_config()
        assert eager.graph.mode == "eager" and eager.executor == "eager"
    for argv, message in [
        (["--enforce-eager", "--graph-mode", "piecewise"], "the graph-mode flags disagree"),
        (["--full-graph", "--enforce-eager"], "the graph-mode flags disagree"),
        (["--enable-piecewise-graph", "--enforce-eager"], "--enable-piecewise-graph asks for graph mode"),
    ]:
        with pytest.raises(ConfigError, match=message):
            EngineArgs.from_cli_args(parser.parse_args(["serve", *argv])).create_engine_config()
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--graph-mode", "full_cudagraph"])


def test_the_bench_runs_graph_mode_by_default() -> None:
    assert kiln_cli.build_parser().parse_args(["bench"]).modes == ["full_and_piecewise"]


def test_unknown_mode_is_rejected_by_the_parser() -> None:
    with pytest.raises(SystemExit):
        kiln_cli.build_parser().parse_args(["bench", "--modes", "eager,turbo"])


def _check_report(path: Path, expected_rows: int) -> dict[str, Any]:
    report = json.loads(path.read_text())
    assert report["config"]["input_len"] == 8 and report["config"]["output_len"] == 4
    assert len(report["results"]) == expected_rows
    for row in report["results"]:
        assert row["num_requests"] == (1 if row["batch_size"] == 1 else 2)
        for key in ("output_tok_s", "prefill_tok_s", "decode_tok_s_per_seq", "wall_s"):
            assert row[key] > 0, (key, row)
        for key in ("ttft_ms", "tpot_ms"):
            assert 0 < row[key]["p50"] <= row[key]["p90"], (key, row)
        assert row["output_tok_s"] * row["wall_s"] == pytest.approx(row["num_requests"] * 4)
    return report


def test_report_prints_rows_and_ratios() -> None:
    runs = [_run("kiln", "eager", 1, 2.0), _run("hf", "eager", 1, 4.0)]
    runs[0].hf_match = 2
    buf = io.StringIO()
    print_report(runs, compute_ratios(runs), Console(file=buf, width=160))
    text = buf.getvalue()
    assert "kiln eager" in text and "2/2" in text and "eager/hf" in text and "2.00x" in text


def test_bench_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    assert kiln_cli.main(["bench", *SMALL, "--json", str(out)]) == 0
    report = _check_report(out, expected_rows=2)
    assert {(r["system"], r["mode"]) for r in report["results"]} == {("kiln", "eager")}
    assert report["ratios"] == {}
    roofline = report["roofline"]
    file_bytes = os.path.getsize(report["config"]["model"])  # the default model is a .gguf file
    assert roofline["gguf_file_bytes"] == file_bytes and roofline["read_bandwidth_gbs"] > 0
    assert roofline["resident_over_file"] == pytest.approx(roofline["resident_weight_bytes"] / file_bytes)
    # SmolLM2 ties its embedding to the logits head, so a decode step reads every resident weight byte
    assert roofline["streamed_bytes_per_token"] == roofline["resident_weight_bytes"] > 0
    bs1, bs2 = sorted(report["results"], key=lambda r: r["batch_size"])
    assert bs1["roofline_efficiency"] == pytest.approx(roofline["roofline_tpot_ms"] / bs1["tpot_ms"]["mean"])
    assert "roofline_efficiency" not in bs2


def test_bench_compare_hf_matches_greedy_tokens(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "bench.json"
    assert kiln_cli.main(["bench", *SMALL, "--compare", "hf", "--json", str(out)]) == 0
    report = _check_report(out, expected_rows=4)
    kiln_rows = [r for r in report["results"] if r["system"] == "kiln"]
    assert len(kiln_rows) == 2 and all(r["hf_match"] == r["num_requests"] for r in kiln_rows), report["results"]
    assert set(report["ratios"]["eager/hf"]) == {"1", "2", "best"}


def test_bench_with_speculation_reports_acceptance_and_matches_hf(tmp_path: Path) -> None:
    """With n-gram speculation the greedy tokens are still HF's, and each kiln row says its acceptance length."""
    pytest.importorskip("transformers")
    out = tmp_path / "bench.json"
    flags = ["--speculative-method", "ngram", "--prompt-lookup-min", "1"]
    assert kiln_cli.main(["bench", *SMALL, *flags, "--compare", "hf", "--json", str(out)]) == 0
    report = _check_report(out, expected_rows=4)
    kiln_rows = [r for r in report["results"] if r["system"] == "kiln"]
    assert all(r["hf_match"] == r["num_requests"] for r in kiln_rows), report["results"]
    assert all(1.0 <= r["acceptance_length"] <= 5.0 for r in kiln_rows)
    assert all("acceptance_length" not in r for r in report["results"] if r["system"] == "hf")


def test_bench_shared_prefix_reports_the_hit_rate(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    assert kiln_cli.main(["bench", *SMALL, "--shared-prefix-len", "32", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["shared_prefix_len"] == 32
    bs1, bs2 = sorted(report["results"], key=lambda r: r["batch_size"])
    # each pass starts from an empty cache: one request alone finds nothing; of two 40-token prompts the second
    # waits for the first's two full 16-token blocks of the shared prefix and takes them (32 of the 80 tokens)
    assert bs1["prefix_hit_rate"] == 0.0
    assert bs2["prefix_hit_rate"] == pytest.approx(32 / 80)
