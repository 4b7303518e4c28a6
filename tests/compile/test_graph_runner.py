"""Trace, split, compile, capture and replay on a tiny random Llama (eager compiler: no codegen cost)."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch

from kiln.compile.modes import PieceMode
from kiln.compile.piece import Piece
from kiln.executor.controls import GraphControls
from kiln.model.forward_context import ForwardContext, ModelInputs, set_forward_context
from tests.compile.tiny import generate, graph_runner, make_runner, prefill_metadata, random_prompts, tiny_model

PROMPTS = random_prompts([5, 3, 9])  # prefill: 17 tokens (> 4: dynamic); decodes: 3 (padded to 4)
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model(num_layers=3)


@pytest.fixture(scope="module")
def expected(model: torch.nn.Module) -> list[list[int]]:
    return generate(make_runner(model), PROMPTS, MAX_TOKENS)


def test_pieces_compile_once_and_capture_per_size(
    model: torch.nn.Module, expected: list[list[int]], cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="kiln"):
        runner, graph = graph_runner(model, cache_dir, compiler="eager", capture_sizes=(1, 2, 4))
    # 3 attention calls -> 4 pieces; the two middle pieces are identical -> 3 compiles; 4 pieces x 3 sizes
    graph.counters.expect(graphs_traced=1, pieces_seen=4, splitting_ops_seen=3, pieces_compiled=3, pieces_captured=12)
    assert len({p.info.structure_key for p in graph.pieces}) == 3
    assert graph.pieces[1].compiled is graph.pieces[2].compiled
    assert caplog.text.count("Compiling a graph for dynamic shape takes") == 3
    assert "Capturing num tokens (num_tokens=4 avail_mem=" in caplog.text
    sizes_logged = [line.split("num_tokens=")[1].split()[0] for line in caplog.text.splitlines() if "Capturing" in line]
    assert sizes_logged == ["4", "2", "1"]  # largest first

    assert generate(runner, PROMPTS, MAX_TOKENS) == expected
    c = graph.counters
    # step 1: one 17-token prefill (above 4: dynamic); steps 2-5: 3 decodes padded to 4 (1 padding token each)
    c.expect(graphs_traced=1, dynamic_fallbacks=1, replays=4, padding_tokens=4, piece_replays=16)
    assert graph.pad_to(3) == 4 and graph.pad_to(4) == 4 and graph.pad_to(5) == 5


def test_piece_modes_switch_without_recompiling(
    model: torch.nn.Module, expected: list[list[int]], cache_dir: Path
) -> None:
    runner, graph = graph_runner(model, cache_dir, compiler="eager", piece_modes="0:eager,1-2:compiled")
    assert graph.piece_modes == {0: PieceMode.EAGER, 1: PieceMode.COMPILED, 2: PieceMode.COMPILED, 3: "captured"}
    # eager piece 0 is not compiled; pieces 1 and 2 share a compile; only piece 3 is captured (3 sizes)
    graph.counters.expect(pieces_compiled=2, pieces_captured=3)
    assert generate(runner, PROMPTS, MAX_TOKENS) == expected
    graph.set_piece_modes({0: "captured", 1: "captured", 2: "captured"})
    graph.counters.expect(pieces_compiled=3, pieces_captured=12)  # piece 0 compiled once, captures added
    graph.set_piece_modes({i: PieceMode.EAGER for i in range(4)})
    graph.set_piece_modes({i: PieceMode.CAPTURED for i in range(4)})
    graph.counters.expect(pieces_compiled=3, pieces_captured=12)
    assert generate(runner, PROMPTS, MAX_TOKENS) == expected


def test_full_graph_mode(model: torch.nn.Module, expected: list[list[int]], cache_dir: Path) -> None:
    runner, graph = graph_runner(model, cache_dir, compiler="eager", mode="full")
    # the whole forward (attention op inside) for mixed steps, compiled once and not captured; the decode graph in
    # 3 layer units (first, middle, last: kiln.compile.decode_units)
    graph.counters.expect(graphs_traced=2, pieces_seen=1, splitting_ops_seen=0, pieces_compiled=4, pieces_captured=0)
    assert generate(runner, PROMPTS, MAX_TOKENS) == expected
    graph.counters.expect(dynamic_fallbacks=1, full_replays=4, full_fallbacks_mixed=1, replays=0)


def test_logits_match_eager_in_fp32(model: torch.nn.Module, cache_dir: Path) -> None:
    runner, graph = graph_runner(model, cache_dir, compiler="eager")
    eager_runner = make_runner(model)
    for n in (1, 3, 4, 6):
        ids = torch.arange(n) % 128
        pos = torch.arange(n)
        meta = prefill_metadata(n)
        with torch.inference_mode():
            with set_forward_context(ForwardContext(meta, eager_runner.kv_caches)):
                want = model.compute_logits(model(ids, pos))
            padded = graph.pad_to(n)
            pad = padded - n
            ids_p = torch.cat([ids, torch.zeros(pad, dtype=torch.long)])
            pos_p = torch.cat([pos, torch.zeros(pad, dtype=torch.long)])
            with set_forward_context(ForwardContext(meta, runner.kv_caches)):
                got = model.compute_logits(graph.forward(ModelInputs(ids_p, pos_p, meta, [], []))[:n])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_rebuild_and_hooks_are_the_public_seams(
    model: torch.nn.Module, expected: list[list[int]], tmp_path: Path
) -> None:
    """What the debugger builds on (its controls): rewritten graphs (extra outputs, compiled-only changes) and launch
    hooks."""
    runner, graph = graph_runner(model, tmp_path, compiler="inductor", capture_sizes=(1, 2, 4))
    controls = GraphControls(graph)
    entries = set((tmp_path / "compile").iterdir())
    seen: list[int] = []

    def with_copy_of_first_output(piece: Piece) -> torch.fx.GraphModule:
        gm = copy.deepcopy(piece.graph)
        out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        out.args = ((*out.args[0], out.args[0][0]),)
        gm.recompile()
        return gm

    changed = controls.rebuild(lambda p: with_copy_of_first_output(p) if p.index == 1 else None)
    assert changed == [1] and not graph.pieces[1].persistent and graph.pieces[0].persistent
    controls.set_piece_hooks(1, after=lambda piece, outs: seen.append(len(outs)))
    assert generate(runner, PROMPTS, MAX_TOKENS) == expected  # the extra output never leaves the piece
    assert seen and set(seen) == {graph.pieces[1].num_outputs + 1}
    assert set((tmp_path / "compile").iterdir()) == entries  # rewritten graphs stay out of the on-disk cache

    def scaled(piece: Piece) -> torch.fx.GraphModule | None:
        gm = copy.deepcopy(piece.graph)
        out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        with gm.graph.inserting_before(out):
            doubled = gm.graph.call_function(torch.mul, (out.args[0][0], 2.0))
        out.args = ((doubled, *out.args[0][1:]),)
        gm.recompile()
        return gm if piece.index == 2 else None

    controls.rebuild(scaled, compiled_only=True)
    assert generate(runner, PROMPTS, MAX_TOKENS) != expected  # compiled and captured code changed
    controls.set_piece_modes({2: PieceMode.EAGER})
    assert generate(runner, PROMPTS, MAX_TOKENS) == expected  # eager still runs the traced graph

    calls: list[int] = []
    controls.set_piece_hooks(0, before=lambda piece, args: calls.append(piece.num_tokens(args)) or args)
    generate(runner, PROMPTS[:1], 2)
    assert calls and calls[0] >= len(PROMPTS[0])


def test_a_piece_changes_through_its_own_methods(model: torch.nn.Module, cache_dir: Path) -> None:
    _, graph = graph_runner(model, cache_dir, compiler="eager")
    piece = graph.pieces[3]
    for name in ("graph", "compile_source", "persistent", "mode", "compiled", "static_compiled", "captures"):
        with pytest.raises(AttributeError):
            setattr(piece, name, None)
    with pytest.raises(TypeError):
        piece.captures[8] = piece.captures[4]  # type: ignore[index]  # a read-only view
    piece.set_mode(PieceMode.EAGER)
    assert piece.mode is PieceMode.EAGER and graph.piece_modes[3] is PieceMode.EAGER


def test_the_capturer_returns_each_sizes_static_inputs(model: torch.nn.Module, cache_dir: Path) -> None:
    _, graph = graph_runner(model, cache_dir, compiler="eager", capture_sizes=(1, 2, 4), piece_modes="3:compiled")
    graph.counters.expect(pieces_captured=9)
    graph.pieces[3].set_mode(PieceMode.CAPTURED)
    inputs = graph.capturer.capture([graph.pieces[3]], [4, 2])
    assert list(inputs) == [4, 2] and all(v.input_ids.shape == v.positions.shape == (n,) for n, v in inputs.items())
    graph.counters.expect(pieces_captured=11)
    assert set(graph.pieces[3].captures) == {4, 2}
    # a size keeps its buffers (the first piece's captures read them), so the dispatcher's copy target never moves
    assert graph.capturer.capture([graph.pieces[3]], [4])[4].input_ids is inputs[4].input_ids
