"""Taps record every boundary in eager and in every piece mode, without changing the partition."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from kiln.compile.split import structure_key
from kiln.debug.session import EAGER, TRACED, DebugSession
from kiln.debug.taps import LOGITS, without_extra_outputs
from tests.compile.tiny import graph_runner
from tests.debug.conftest import NUM_DECODE, PROMPT
from tests.debug.models import NUM_LAYERS, tiny_llama


def test_taps_keep_the_partition_and_graph_hashes(open_tiny: Callable[..., DebugSession], tmp_path: Path) -> None:
    _, plain = graph_runner(tiny_llama(), tmp_path, compiler="eager", capture_sizes=(1, 2, 4, 8))
    plain_keys = [p.info.structure_key for p in plain.pieces]
    session = open_tiny()
    pieces = session.graph.pieces
    assert [p.info.submod_name for p in pieces] == [p.info.submod_name for p in plain.pieces]
    assert session.base_keys == plain_keys
    for piece, probe, production in zip(pieces, session.probes, plain.pieces, strict=True):
        # the tapped graph only gains outputs: without them it hashes exactly like the production piece's graph
        untapped = without_extra_outputs(piece.graph, probe.num_outputs)
        assert structure_key(untapped) == structure_key(production.graph)
        assert piece.info.structure_key == production.info.structure_key
    assert len({p.info.structure_key for p in pieces}) == 3  # identical middle pieces still share one key


def test_boundaries_sit_in_the_pieces_that_compute_them(open_tiny: Callable[..., DebugSession]) -> None:
    session = open_tiny()
    where = {b.name: b.piece for b in session.boundaries}
    assert where["embed"] == 0
    for k in range(NUM_LAYERS):
        # layer K's attention output (o_proj) and MLP come after the attention op: piece K+1
        assert where[f"layers.{k}.attn"] == where[f"layers.{k}.mlp"] == k + 1
    assert where["norm"] == NUM_LAYERS and where[LOGITS] is None
    assert len(session.boundaries) == 2 * NUM_LAYERS + 3


def test_every_mode_records_every_boundary_for_every_token(open_tiny: Callable[..., DebugSession]) -> None:
    session = open_tiny()
    runs = {path: session.run(path, PROMPT, NUM_DECODE) for path in (EAGER, TRACED, "compiled", "captured")}
    eager = runs[EAGER]
    assert eager.step_rows == [len(PROMPT)] + [1] * NUM_DECODE
    for path, run in runs.items():
        assert run.step_rows == eager.step_rows, path
        assert [set(step) for step in run.steps] == [{b.name for b in session.boundaries}] * (NUM_DECODE + 1)
        for b in session.boundaries:
            rows = NUM_DECODE + 1 if b.name == LOGITS else len(PROMPT) + NUM_DECODE
            assert run.boundary(b.name).shape[0] == rows, (path, b.name)
            torch.testing.assert_close(run.boundary(b.name), eager.boundary(b.name), rtol=1e-4, atol=1e-4)
    session.graph.counters.expect(pieces_captured=5 * 4)  # taps added no piece and no capture
