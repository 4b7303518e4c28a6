"""`kiln bench --compare` parsing and anchors (llama.cpp without llama_cpp installed), and the roofline arithmetic."""

from __future__ import annotations

import io
import sys
import types
from pathlib import Path

import pytest
from rich.console import Console
from torch import nn

import kiln.bench.commands as bench_commands
import kiln.cli as kiln_cli
from kiln.bench.anchors import ANCHORS
from kiln.bench.cli import ANCHOR_NAMES
from kiln.bench.llamacpp_runner import _closed_loop, check_llamacpp
from kiln.bench.metrics import RunResult, compute_ratios
from kiln.bench.report import print_report
from kiln.bench.roofline import Roofline, streamed_weight_bytes
from kiln.errors import ConfigError, KilnError
from kiln.model.build import resident_weight_bytes
from kiln.model.loader import resolve_model_path
from kiln.quant.linear import PackedEmbedding

SMALL = ["--num-requests", "2", "--num-requests-bs1", "1", "--input-len", "8", "--output-len", "4"]


def _compare(*flags: str) -> list[str]:
    return kiln_cli.build_parser().parse_args(["bench", *flags]).compare


def test_compare_takes_a_comma_list_or_repeated_flags() -> None:
    assert _compare() == []
    assert _compare("--compare", "hf") == ["hf"]
    assert _compare("--compare", "hf,llama.cpp") == ["hf", "llama.cpp"]
    assert _compare("--compare", "llama.cpp", "--compare", "hf") == ["llama.cpp", "hf"]
    with pytest.raises(SystemExit):
        _compare("--compare", "hf,sglang")
    assert set(ANCHOR_NAMES) == set(ANCHORS)  # the parser's names are the registry's


def test_missing_llama_cpp_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` now raises ImportError
    with pytest.raises(KilnError, match=r"make llamacpp"):
        check_llamacpp(resolve_model_path("default"))


def test_missing_llama_cpp_fails_the_bench_before_any_timing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Refused before any engine is built (the anchors are checked on the model's path first)."""
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    monkeypatch.setattr(bench_commands, "LLM", _no_engine)
    out = tmp_path / "bench.json"
    assert kiln_cli.main(["bench", *SMALL, "--compare", "llama.cpp", "--json", str(out)]) == 1
    captured = capsys.readouterr()
    assert "kiln: error: --compare llama.cpp needs llama-cpp-python" in captured.err
    assert "make llamacpp" in captured.err
    assert "kiln bench" not in captured.out and not out.exists()  # no table, no report


def _no_engine(*args: object, **kwargs: object) -> None:
    raise AssertionError("an engine was built before the anchors were checked")


def test_llama_cpp_needs_a_gguf_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", types.ModuleType("llama_cpp"))  # importable, so the path decides
    check_llamacpp(resolve_model_path("default"))
    with pytest.raises(ConfigError, match=r"llama.cpp needs a .gguf file; kiln loaded .*hf-dir"):
        check_llamacpp(str(tmp_path / "hf-dir"))


class _FakeContext:
    """Stands in for a llama.cpp context: the greedy next token of a feed is the position it would take, so a
    request's tokens come out right only when every feed carries the right positions."""

    def __init__(self) -> None:
        self.steps: list[list[tuple[int, list[int], int]]] = []
        self.live: set[int] = set()

    def clear(self) -> None:
        self.live.clear()

    def decode(self, feeds: list[tuple[int, list[int], int]]) -> list[int]:
        for seq, tokens, pos in feeds:
            is_prompt = pos == 0 and len(tokens) == 4
            assert is_prompt == (seq not in self.live), "a prompt goes to a free sequence"
            assert is_prompt or len(tokens) == 1, "a running request feeds its last token"
            self.live.add(seq)
        self.steps.append(feeds)
        return [pos + len(tokens) for _, tokens, pos in feeds]

    def free_sequence(self, seq: int) -> None:
        self.live.remove(seq)


def test_llama_cpp_closed_loop_refills_free_sequences() -> None:
    ctx = _FakeContext()
    prompts = [[i] * 4 for i in range(5)]
    _, requests = _closed_loop(ctx, prompts, 3, 2, None)  # type: ignore[arg-type]
    assert [r.prompt for r in requests] == prompts
    assert all(r.token_ids == [4, 5, 6] for r in requests)
    assert all(r.arrival_time <= r.first_token_time <= r.finished_time for r in requests)
    # requests 0,1 run 3 steps, then 2,3, then 4 alone: 9 steps, never more than 2 sequences
    assert len(ctx.steps) == 9 and max(len(feeds) for feeds in ctx.steps) == 2
    assert [seq for seq, _, _ in ctx.steps[6]] == [0] and not ctx.live


def test_roofline_arithmetic() -> None:
    roofline = Roofline(
        resident_weight_bytes=1_000_000_000,
        streamed_bytes_per_token=500_000_000,
        read_bandwidth_gbs=10.0,
        gguf_file_bytes=250_000_000,
    )
    assert roofline.roofline_tpot_s == pytest.approx(0.05)  # 0.5 GB at 10 GB/s
    assert roofline.efficiency(0.1) == pytest.approx(0.5)
    assert roofline.resident_over_file == pytest.approx(4.0)
    assert roofline.to_dict()["roofline_tpot_ms"] == pytest.approx(50.0)
    assert Roofline(1, 1, 1.0, None).resident_over_file is None


class _TinyLM(nn.Module):
    def __init__(self, tied: bool, packed_table: bool = False) -> None:
        super().__init__()
        self.embed = PackedEmbedding(10, 32) if packed_table else nn.Embedding(10, 32)
        self.head = nn.Linear(32, 10, bias=False)
        if tied:
            self.head.weight = self.embed.weight


def test_streamed_bytes_leave_out_an_untied_embedding_only() -> None:
    head_bytes = 10 * 32 * 4
    untied = _TinyLM(tied=False)
    assert resident_weight_bytes(untied) == 2 * head_bytes
    assert streamed_weight_bytes(untied) == head_bytes  # the table is only gathered
    assert streamed_weight_bytes(_TinyLM(tied=True)) == resident_weight_bytes(_TinyLM(tied=True)) == head_bytes
    packed = _TinyLM(tied=False, packed_table=True)
    assert resident_weight_bytes(packed) > head_bytes and streamed_weight_bytes(packed) == head_bytes


def test_a_head_read_in_a_second_form_counts_the_forms_bytes() -> None:
    """A float head whose one-row product reads a copy (kiln.kernels.head_forms): the copy's bytes replace the
    head's, and a table tied to it is then only gathered."""
    for tied in (False, True):
        model = _TinyLM(tied=tied)
        assert streamed_weight_bytes(model, {model.head.weight.data_ptr(): 100}) == 100, tied
        assert streamed_weight_bytes(model, {}) == streamed_weight_bytes(model)


def _run(system: str, mode: str, batch_size: int, wall_s: float) -> RunResult:
    return RunResult(system, mode, batch_size, 8, 4, wall_s, 0.5, [0.1, 0.3], [0.2, 0.2], [[1, 2, 3, 4]] * 2)


def test_ratios_and_report_cover_llama_cpp_and_the_roofline() -> None:
    runs = [_run("kiln", "eager", 1, 2.0), _run("kiln", "eager", 2, 1.0)]
    runs += [_run("llama.cpp", "sequential", 1, 4.0), _run("llama.cpp", "batched", 2, 1.0)]
    runs[0].roofline_efficiency = 0.25
    runs[1].prefix_hit_rate = 0.75
    runs[1].acceptance_length = 3.5
    ratios = compute_ratios(runs)
    assert ratios["eager/llama.cpp"]["1"]["output_tok_s"] == pytest.approx(2.0)
    assert ratios["eager/llama.cpp"]["2"]["output_tok_s"] == pytest.approx(1.0)
    assert ratios["eager/llama.cpp"]["best"] == pytest.approx(1.0)
    assert runs[0].to_row()["roofline_efficiency"] == 0.25 and "roofline_efficiency" not in runs[1].to_row()
    buf = io.StringIO()
    print_report(runs, ratios, Console(file=buf, width=200), roofline=Roofline(2_000_000, 1_000_000, 10.0, 500_000))
    text = buf.getvalue()
    assert "llama.cpp batched" in text and "llama.cpp sequential" in text and "25%" in text
    assert "prefix hits" in text and "75%" in text and runs[1].to_row()["prefix_hit_rate"] == 0.75
    assert "accept len" in text and "3.50" in text and runs[1].to_row()["acceptance_length"] == 3.5
    assert "2.0 MB resident (4.00x the 0.5 MB GGUF file)" in text and "0.10 ms/token" in text
