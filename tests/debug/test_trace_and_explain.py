"""Trace mode logs every piece launch and catches replays on moved buffers; explain names untraceable modules."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from kiln.cli import main
from kiln.compile.capture import CaptureAddressError
from kiln.debug.explain import explain_model
from kiln.debug.session import DebugSession
from kiln.debug.trace import trace_level
from kiln.model.attention import allocate_kv_caches
from tests.debug.conftest import NUM_DECODE, PROMPT
from tests.debug.models import NUM_LAYERS, tiny_llama_graph_break


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def logged_run(session: DebugSession) -> list[str]:
    """The kiln log lines of one captured run (prefill and NUM_DECODE decode steps)."""
    handler = Lines()
    logger = logging.getLogger("kiln")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        session.run("captured", PROMPT, NUM_DECODE)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return handler.lines


def test_trace_mode_logs_one_line_per_piece_launch(
    open_tiny: Callable[..., DebugSession], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KILN_DEBUG", "1")
    session = open_tiny(graph_mode="piecewise")
    session.set_modes("captured")  # captures now, so the run below only replays
    lines = logged_run(session)
    launches = [line for line in lines if line.startswith("piece ")]
    assert len(launches) == (NUM_LAYERS + 1) * (NUM_DECODE + 1)
    assert launches[0].startswith("piece 0 (model.embed_tokens .. model.layers.0.self_attn.rotary_emb) mode=captured")
    assert "launch=replay num_tokens=7 padded=8 time=" in launches[0] and launches[0].endswith(" ms")
    assert "num_tokens=1 padded=1" in launches[-1]


def test_trace_mode_logs_the_full_decode_graph_launches(
    open_tiny: Callable[..., DebugSession], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KILN_DEBUG", "1")
    session = open_tiny()  # full_and_piecewise: the prefill runs the pieces, every decode step the full graph
    session.set_modes("captured")
    lines = logged_run(session)
    pieces = [line for line in lines if line.startswith("piece ")]
    full = [line for line in lines if line.startswith("full decode graph ")]
    assert len(pieces) == NUM_LAYERS + 1 and len(full) == NUM_DECODE
    assert ".. model.norm) mode=captured launch=dynamic num_tokens=1 padded=1" in full[0]


def test_trace_mode_fails_loudly_when_a_replay_reads_other_memory(
    open_tiny: Callable[..., DebugSession], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KILN_DEBUG", "1")
    session = open_tiny(graph_mode="piecewise")
    session.set_modes("captured")
    capture = session.graph.pieces[2].captures[1]
    i, buf = capture.inputs[0]
    capture.inputs[0] = (i, buf.clone())  # the replay would copy its input where the capture never reads
    with pytest.raises(CaptureAddressError, match=r"piece 2 .* replay copies input \d+ into .* stale data"):
        session.run("captured", PROMPT, NUM_DECODE)


def test_recipe_debug_mode_turns_trace_mode_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KILN_DEBUG", raising=False)
    assert trace_level(None) == 0
    assert trace_level(SimpleNamespace(debug_mode=True)) == 1
    monkeypatch.setenv("KILN_DEBUG", "1")
    assert trace_level(SimpleNamespace(debug_mode=False)) == 1


def test_explain_names_module_op_line_and_hint() -> None:
    model = tiny_llama_graph_break()
    kv_caches = allocate_kv_caches(model.config, 2, 16, next(model.parameters()).dtype, "cpu")
    explanation = explain_model(model, kv_caches, ("kiln.attention",))
    kinds = [(f.kind, f.module_path.split(" ")[0], f.op) for f in explanation.findings]
    assert kinds == [
        ("graph break", "model.layers.1.mlp", "posix.getpid"),
        ("trace failure", "model.layers.2.mlp", "kiln_debug_test.scale_no_fake"),
    ]
    unregistered = explanation.findings[1]
    assert "tests/debug/models.py:" in unregistered.location and "scale_no_fake(x)" in unregistered.location
    assert "register_fake" in unregistered.hint and "scale_no_fake.register_fake" in unregistered.hint
    assert "model.layers.2.mlp (NoFakeMLP)" in explanation.format()


def test_explain_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["debug", "explain", "--model", "tests.debug.models:tiny_llama_unregistered_op"]) == 1
    out = capsys.readouterr().out
    assert "trace failure in model.layers.2.mlp (NoFakeMLP)" in out and "hint: register a fake" in out
    assert main(["debug", "explain", "--model", "tests.debug.models:tiny_llama"]) == 0
    assert f"splits into {NUM_LAYERS + 1} pieces" in capsys.readouterr().out


def test_explain_reads_the_recipe(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--recipe is validated first (a broken recipe is reported, nothing is traced), then its settings apply."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("recipe_version: 1\nmodel: {name: m, path: default}\ngraph: {splitting_ops: [kiln.atention]}\n")
    assert main(["debug", "explain", "--recipe", str(bad)]) != 0
    err = capsys.readouterr().err
    assert "bad.yaml:3" in err and "unknown splitting op 'kiln.atention'" in err and "Traceback" not in err
