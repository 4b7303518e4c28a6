"""`kiln loadtest` limits and report, and the serve/launch argument parsers (no server, no model)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kiln.bench.commands import run_loadtest_command
from kiln.bench.loadtest import LoadTestConfig, LoadTestResult, RequestRecord, check_loopback_url, parse_range
from kiln.bench.loadtest_report import format_report, summarize
from kiln.command import resolve_handler
from kiln.errors import ConfigError
from kiln.launch import build_parser as build_launch_parser
from kiln.server.cli import add_loadtest_subcommand, add_serve_subcommand
from kiln.server.launcher import run_server


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:8000", "http://localhost:1", "http://[::1]:8000", "https://127.9.9.9"]
)
def test_loopback_urls_are_accepted(url: str) -> None:
    check_loopback_url(url)


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://example.com", "ftp://127.0.0.1", "127.0.0.1:8000"])
def test_other_urls_are_refused(url: str) -> None:
    with pytest.raises(ConfigError):
        check_loopback_url(url)


def test_refusal_exits_2_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(
        url="http://192.168.1.5:8000", model=None, api_key=None, concurrency=1, num_requests=1, input_len="1:2",
        output_len="1:2", request_rate=None, timeout=1.0, seed=0, json=None, plot=None, shared_prefix_len=0,
        turns=1,
    )  # fmt: skip
    assert run_loadtest_command(args) == 2
    assert "only targets loopback addresses" in capsys.readouterr().err


def test_ranges_and_bounds() -> None:
    assert parse_range("32:256", "--input-len") == (32, 256)
    assert parse_range("8", "--output-len") == (8, 8)
    for bad in ("0:4", "9:3", "a:b"):
        with pytest.raises(ConfigError, match="--input-len"):
            parse_range(bad, "--input-len")
    with pytest.raises(ConfigError, match="--num-requests"):
        LoadTestConfig("http://127.0.0.1:1", concurrency=1, num_requests=10**9, input_len=(1, 2), output_len=(1, 2))
    lengths = dict(concurrency=1, num_requests=4, input_len=(1, 2), output_len=(1, 2))
    with pytest.raises(ConfigError, match=r"--turns must be in \[1, --num-requests 4\], got 5"):
        LoadTestConfig("http://127.0.0.1:1", turns=5, **lengths)
    with pytest.raises(ConfigError, match="--shared-prefix-len must be in"):
        LoadTestConfig("http://127.0.0.1:1", shared_prefix_len=-1, **lengths)


def test_summary_percentiles_and_errors() -> None:
    cfg = LoadTestConfig("http://127.0.0.1:1", concurrency=2, num_requests=4, input_len=(1, 2), output_len=(1, 2))
    records = [
        RequestRecord(i, 0.0, 2, 2, prompt_tokens=2, output_tokens=2, ttft=0.1 * (i + 1), tpot=0.05, e2e=0.2 * (i + 1))
        for i in range(3)
    ]
    records.append(RequestRecord(3, 0.0, 2, 2, error="HTTP 429: the server is full"))
    summary = summarize(LoadTestResult(cfg, 2.0, records))
    assert summary["num_completed"] == 3 and summary["num_errors"] == 1
    assert summary["request_throughput"] == pytest.approx(1.5)
    assert summary["e2e_s"]["p50"] == pytest.approx(0.4)
    assert "api_key" not in summary["config"]
    report = format_report(summary)
    assert "TTFT" in report and "error x1: HTTP 429" in report
    assert summary["prefix_cache_hit_rate"] is None and "did not report cached prompt tokens" in report
    records[0].cached_tokens, records[1].cached_tokens = 0, 2  # the third request's server said nothing
    summary = summarize(LoadTestResult(cfg, 2.0, records))
    assert summary["cached_prompt_tokens"] == 2 and summary["prefix_cache_hit_rate"] == pytest.approx(0.5)
    assert "Prefix cache: 2 of 4 prompt tokens cached (50.0%)" in format_report(summary)  # of those that reported
    assert summary["speculative_decoding"] is None and "Speculative" not in format_report(summary)
    before = {"num_drafts": 10, "num_draft_tokens": 40, "num_accepted_tokens": 20, "num_emitted_tokens": 30}
    after = {"num_drafts": 30, "num_draft_tokens": 120, "num_accepted_tokens": 50, "num_emitted_tokens": 80}
    summary = summarize(LoadTestResult(cfg, 2.0, records, (before, after)))  # the server's counts over the test
    assert summary["speculative_decoding"]["mean_acceptance_length"] == pytest.approx(1 + 30 / 20)
    assert (
        "Speculative decoding: 30 of 80 draft tokens accepted (37.5%) in 20 verifications, mean acceptance "
        "length 2.50" in format_report(summary)
    )


def test_serve_and_launch_parsers() -> None:
    parser = argparse.ArgumentParser(prog="kiln")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_subcommand(sub)
    add_loadtest_subcommand(sub)
    args = parser.parse_args(["serve", "--recipe", "r.yaml", "--enable-piecewise-graph", "--max-num-seqs", "4"])
    assert args.host == "127.0.0.1" and args.port == 8000 and resolve_handler(args.handler) is run_server
    assert args.recipe == "r.yaml" and args.enable_piecewise_graph and args.max_num_seqs == 4
    assert resolve_handler(parser.parse_args(["loadtest"]).handler) is run_loadtest_command

    launch = build_launch_parser().parse_args(["--model-path", "m.gguf", "--enable-piecewise-graph", "--port", "9"])
    assert launch.model == "m.gguf" and launch.enable_piecewise_graph and launch.port == 9
    assert build_launch_parser().parse_args([]).model == "default"
    assert resolve_handler(launch.handler) is run_server


def test_serve_on_a_taken_port_fails_cleanly(tmp_path: Path) -> None:
    """The engine loop runs on the main thread and HTTP in a thread: a bind failure must still end the process
    with a one-line error and a non-zero exit, not hang in the engine loop."""
    import socket
    import subprocess
    import sys

    from tests.engine.tiny_models import write_gguf_model

    model = tmp_path / "tiny.gguf"
    write_gguf_model(model)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [
            sys.executable,
            "-m",
            "kiln.launch",
            "--model-path",
            str(model),
            "--graph-mode",
            "eager",
            "--port",
            str(port),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "address already in use" in proc.stderr and f"Could not serve on 127.0.0.1:{port}" in proc.stderr
    assert "Traceback" not in proc.stderr
